"""The two Lua scripts of a shared budget, as Redis runs them (outrate.budget.shared.lease
loads and calls them). Kept apart from the client: they are the part that
decides, and read best on their own.

Both read the server's `TIME`, so no engine clock enters a decision, and
every integer they form stays below 2**53 (Lua numbers are doubles;
`Units.of` refuses limits that would not).
"""

LEASE_SCRIPT = """
-- One call leases for every user of one group (one hash tag: one slot).
-- KEYS[1] the group's epoch; per user i, KEYS[2i] its TAT and KEYS[2i+1]
-- its demand.
-- ARGV[1] engine, ARGV[2] demand_ttl_us, ARGV[3] the epoch this engine last
--   saw in this group ('-': none yet), then one per user, ten integers
--   separated by spaces: demand credit want refund p num tol_us horizon_us
--   debt_us flags (1: write this engine's demand entry, else it is fresh;
--   2: this user's state was lost here, assume the worst).
-- Returns one string: granted fair wait_us total_demand per user, then the
-- server's now, the group's epoch and 1 if it is not the one the engine
-- saw (one string: a reply of 40,000 integers costs the client more to
-- read than the script costs Redis).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local eid = ARGV[1]
local dttl = tonumber(ARGV[2])
local function floor_div(a, b) return (a - math.fmod(a, b)) / b end
local function ceil_div(a, b)
  local r = math.fmod(a, b)
  local q = (a - r) / b
  if r > 0 then q = q + 1 end
  return q
end
-- The epoch: made once per group and kept a day past its last call (every
-- key expires on its own), so its absence, or another value, means the
-- group's state was lost since this engine last called (FLUSHALL, FLUSHDB,
-- a restart without persistence).
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  epoch = string.format('%.0f', now)
  redis.call('SET', KEYS[1], epoch, 'PX', 86400000)
elseif redis.call('PTTL', KEYS[1]) < 43200000 then
  redis.call('PEXPIRE', KEYS[1], 86400000)
end
local reset = ARGV[3] ~= '-' and ARGV[3] ~= epoch
local users = {}
for i = 2, #KEYS do users[i - 1] = KEYS[i] end
local state = redis.call('MGET', unpack(users))
-- What this call wrote, by key: a user twice in one call (never sent, but
-- cheap to rule out) must see its first grant, not the MGET's snapshot.
local written = {}
local function current(key, j)
  local w = written[key]
  if w == nil then return state[j] end
  return w
end
-- Write `text` to `key` until `expiry` (server us), or delete it (text false).
local function put(key, text, expiry)
  written[key] = text
  if text then
    redis.call('SET', key, text, 'PX', ceil_div(expiry - now, 1000))
  else
    redis.call('DEL', key)
  end
end
local out = {}
local n = 0
local args = '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) ([0-3])$'
for i = 1, #users / 2 do
  local tkey, dkey = users[2 * i - 1], users[2 * i]
  local dem, credit, want, refund, p, num, tol, horizon, debt, flags =
    string.match(ARGV[3 + i], args)
  if not flags then
    return redis.error_reply('outrate lease: bad arguments for ' .. tkey)
  end
  dem, credit, want, refund = tonumber(dem), tonumber(credit), tonumber(want), tonumber(refund)
  p, num, tol, horizon = tonumber(p), tonumber(num), tonumber(tol), tonumber(horizon)
  debt, flags = tonumber(debt), tonumber(flags)
  local reg = flags % 2 == 1
  local lost = reset or flags >= 2
  local reach = math.max(tol, horizon)
  local tat0 = tonumber(current(tkey, 2 * i - 1) or '0')
  local tat = tat0
  -- Unused credit comes back first; a refund can at most fill the bucket.
  if refund > 0 then
    tat = math.max(tat - floor_div(refund * num, p), now)
  end
  -- After an outage: what this engine spent while Redis was away, at most
  -- the whole burst (no one gets a burst on recovery).
  if debt > 0 then
    tat = math.max(tat, math.min(math.max(tat, now) + debt, now + tol))
  end
  -- State lost (the epoch changed, or the engine learnt it in another
  -- call): the TAT may have been anywhere up to a grant's reach and one
  -- token past it, so it is put there. A reset never grants a token the
  -- lost state would have refused; it costs the user at most that wait.
  -- The demand entry is written again (it was lost too).
  if lost then
    tat = math.max(tat, now + reach + ceil_div(num, p))
    reg = true
  end
  -- Demand: one line `demand:expiry_us:engine` per engine (engine ids,
  -- host:pid:suffix, hold no newline). Expired lines go; this engine's is
  -- rewritten when it registers, dropped at demand 0.
  local total, last, changed = 0, 0, false
  local kept = {}
  for d, xs, e in string.gmatch(current(dkey, 2 * i) or '', '(%d+):(%d+):([^\\n]*)\\n') do
    local x = tonumber(xs)
    if x <= now or (e == eid and (reg or dem == 0)) then
      changed = true
    else
      if e ~= eid then total = total + tonumber(d) end
      kept[#kept + 1] = d .. ':' .. xs .. ':' .. e .. '\\n'
      if x > last then last = x end
    end
  end
  if dem > 0 then
    total = total + dem
    if reg then
      local x = now + dttl
      kept[#kept + 1] = string.format('%d:%.0f:', dem, x) .. eid .. '\\n'
      if x > last then last = x end
      changed = true
    end
  end
  if changed then
    put(dkey, #kept > 0 and table.concat(kept), last)
  end
  -- The grant: this engine's fair slice of one horizon, less what it holds,
  -- at most `want`, as many tokens as conform by now + max(burst, horizon).
  -- The slice must carry the engine until its next answer, one horizon
  -- away: granting only what conforms now would cap a user at a burst per
  -- round trip once round trips outlast the burst. The engine paces its
  -- spending locally, so tokens granted ahead are not spent ahead.
  local granted = 0
  local fair = want
  if dem > 0 then
    if horizon > 0 then
      fair = ceil_div(horizon * p * dem, num * total)
      if fair < 1 then fair = 1 end
      if fair > want then fair = want end
    end
    local ask = fair - credit
    if ask > 0 then
      local base = math.max(tat, now)
      local room = now + reach - base
      if room >= 0 then
        local k = floor_div(room * p, num) + 1
        if k > ask then k = ask end
        granted = k
        tat = base + ceil_div(k * num, p)
      end
    end
  end
  -- The TAT is kept 10 s past itself, not dropped once it is past: while
  -- a cluster slot migrates, a call whose keys are all on one side runs
  -- there, one with a key on neither side gets TRYAGAIN until it is done.
  if tat ~= tat0 then
    put(tkey, string.format('%.0f', tat), math.max(tat, now) + 10000000)
  end
  local wait = tat - reach - now
  if wait < 0 then wait = 0 end
  out[n + 1], out[n + 2], out[n + 3], out[n + 4] = granted, fair, wait, total
  n = n + 4
end
out[n + 1] = string.format('%.0f', now)
out[n + 2] = epoch
out[n + 3] = reset and 1 or 0
return table.concat(out, ' ')
"""

HEARTBEAT_SCRIPT = """
-- KEYS[1] the engines hash, KEYS[2] this engine's key (one hash tag: one slot).
-- ARGV: engine, policy sha256, ttl_us (0: leave), keep_us, n (the live
-- engines this one counts, itself included: what its fallback divides by).
-- An entry reads `expiry:sha256,keep_us:n`: keep_us is how long the others
-- keep this engine's part once its heartbeat stopped (its hold, a retry and
-- a connect). One that expired without leaving (an engine dead, or cut off
-- from this store and in its fallback) is kept for its own keep_us (an
-- entry without one: the caller's) and reported as missing; one that left
-- is gone at once. The keep rides in the sha's field so that engines of the
-- version before read the entry (as a policy mismatch) rather than drop it.
-- Returns {live: id, sha256, keep_us, ...}, {missing: id, n, ...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[3])
local keep = tonumber(ARGV[4])
if ttl > 0 then
  local entry = string.format('%.0f', now + ttl) .. ':' .. ARGV[2] .. ',' ..
    string.format('%.0f', keep) .. ':' .. ARGV[5]
  redis.call('HSET', KEYS[1], ARGV[1], entry)
  redis.call('SET', KEYS[2], ARGV[2], 'PX', math.ceil(ttl / 1000))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
end
local live, missing = {}, {}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local x, sha, k, n = string.match(fields[i + 1], '^(%d+):([^:,]*),?(%d*):?(%d*)$')
  x = tonumber(x or '0')
  local held = keep
  if k ~= nil and k ~= '' then held = tonumber(k) end
  if x > now then
    live[#live + 1] = fields[i]
    live[#live + 1] = sha
    live[#live + 1] = k ~= '' and k or '0'
  elseif x + held > now then
    missing[#missing + 1] = fields[i]
    missing[#missing + 1] = n ~= '' and n or '1'
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
return {live, missing}
"""

USAGE_SCRIPT = """
-- Quota usage of one group's users (one hash tag: one slot), each engine's
-- count kept apart so that a write is idempotent: an engine writes its own
-- running count of a window, never a difference, so a retried or repeated
-- call adds nothing, and a store that lost its state is written back whole
-- by the engines still running.
-- KEYS: per user i, KEYS[2i-1] its usage hash (field
--   `kind/window/start/engine` -> that engine's count in that window),
--   KEYS[2i] its reset mark (server us of the operator's last reset).
-- ARGV[1] this engine's quota id, ARGV[2] the hash's TTL in ms, then per
--   user one string: `applied n kind/window start count ...` (n triples;
--   applied: the last reset mark this engine applied, 0 for none).
-- Per user, one line of the reply: `mark total ...`: the reset mark (0 for
-- none) and, per triple in order, the user's count over every engine in
-- that window. A mark newer than `applied` means the operator reset the
-- user: nothing of this engine's is written (its counts predate the reset).
local eid = ARGV[1]
local ttl = tonumber(ARGV[2])
local lines = {}
for i = 1, #KEYS / 2 do
  local hkey, rkey = KEYS[2 * i - 1], KEYS[2 * i]
  local words = {}
  for w in string.gmatch(ARGV[2 + i], '%S+') do words[#words + 1] = w end
  local applied, n = tonumber(words[1]), tonumber(words[2])
  local mark = tonumber(redis.call('GET', rkey) or '0')
  local stale = mark > applied
  local want = {}
  for j = 0, n - 1 do
    local kw, start, count = words[3 + 3 * j], words[4 + 3 * j], tonumber(words[5 + 3 * j])
    want[#want + 1] = kw .. '/' .. start
    if not stale and count > 0 then
      local field = kw .. '/' .. start .. '/' .. eid
      local cur = tonumber(redis.call('HGET', hkey, field) or '0')
      if count > cur then redis.call('HSET', hkey, field, count) end
    end
  end
  local totals, current = {}, {}
  for _, w in ipairs(want) do
    totals[w] = 0
    local kw, start = string.match(w, '^(.*)/(%d+)$')
    current[kw] = tonumber(start)
  end
  local fields = redis.call('HGETALL', hkey)
  for f = 1, #fields, 2 do
    local kw, start = string.match(fields[f], '^([^/]+/[^/]+)/(%d+)/')
    if kw then
      local w = kw .. '/' .. start
      if totals[w] ~= nil then
        totals[w] = totals[w] + tonumber(fields[f + 1])
      elseif current[kw] ~= nil and tonumber(start) < current[kw] then
        redis.call('HDEL', hkey, fields[f])  -- a window that has passed
      end
    end
  end
  if #fields > 0 then redis.call('PEXPIRE', hkey, ttl) end
  local out = {string.format('%.0f', mark)}
  for _, w in ipairs(want) do out[#out + 1] = string.format('%.0f', totals[w]) end
  lines[#lines + 1] = table.concat(out, ' ')
end
return table.concat(lines, '\\n')
"""

RESET_SCRIPT = """
-- The operator's reset of one user's quota usage: every engine's count
-- goes, and the reset mark (server time, us) tells each engine to forget
-- its own count at its next call. KEYS[1] the usage hash, KEYS[2] the mark.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], string.format('%.0f', now), 'PX', tonumber(ARGV[1]))
return string.format('%.0f', now)
"""
