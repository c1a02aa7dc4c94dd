"""Work-conserving limits on a real `outrate serve` (issue 33's guarantees),
each read from the engine's own trace (`borrowed` marks borrowed tokens):

- work conserved: `borrower` {rate: 20, peak: unlimited}, alone with 8
  streams, runs at least 0.9x what an unlimited user's 8 streams run on the
  same engine (an unlimited user is scheduled exactly as stock vLLM: the
  step-by-step equality tests in tests/test_scheduler.py);
- peak holds: `peaky` {rate: 20, peak: 100} stays within the GCRA bound at
  100 tok/s in every window (+1 token: two buckets, see policy-reference.md);
- no harm: `committed` {rate: 100} with 1 stream, and `roomy` {rate: 5000,
  which 12 streams on this engine stay within} with 12 (every active slot),
  each beside the borrower's 48 streams (3x --max-num-seqs), starting within
  its committed rate: tokens per scheduler step, while all its streams are
  in the engine, at least 0.9x alone, and the engine's time to first token
  (arrival to first token, in steps: the trace's `arrived` and `first`) p50
  at most one step more than alone;
- borrowing in time (issue 40): `committed`'s engine tok/s past the burst
  beside the borrower is at least 0.9x what it is due, in tokens per
  second, not per step: its rate, or, where the machine gives it less
  than that without borrowers, what it gives (`_due`: the least of its
  tok/s alone a few seconds before and what the steps with its work alone
  ran at in the same seconds). Borrowers spend only step time no committed
  user needs (vllm_integration/step/steptime.py); the machine's own speed,
  which another test lane on two cores moves by a third between runs a
  few seconds apart, is measured, not assumed. `roomy`'s is printed (its 5000 tok/s is more
  than the engine makes: nothing is lent beside it either). The same with
  a rate sized to the machine at the time (`brisk`), so that the check
  bites however fast the steps are. The client's first token is printed,
  not asserted: it includes the API server, which shares two cores with 48
  streams. (A user over its committed rate waits for its own budget, which
  a borrower does not change: tests/test_scheduler_lending.py);
- reclaim: while an unlimited user keeps every active slot busy, the
  borrower's tokens obey its committed bound plus one step of borrowed tokens
  (at most --max-num-active-seqs). The borrower runs 4 streams there: with
  more, fair admission would share the 16 resident slots between the two
  users (8 each), as it does when the borrower is capped, and the unlimited
  user could not fill the 12 active ones.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

pytest.importorskip("vllm")

from e2e_support import (  # noqa: E402
    BURST_NS,
    POLICY,
    assert_complete,
    engine_steps,
    step_rate,
    trace_steps,
    use_policy,
    wait_idle,
)
from loadgen import run_concurrently  # noqa: E402
from serverproc import replay_once  # noqa: E402

from outrate.observe.trace import engine_rate, gcra_allowed, max_window_excess  # noqa: E402
from vllm_integration.step.steptime import HEADROOM  # noqa: E402

ACTIVE = 12  # the shared server's --max-num-active-seqs (e2e_support.session_server)
COMMITTED = {"committed": 100, "roomy": 5000}  # their rates in e2e_support.POLICY
SEQS = 16


def _rate(server, user: str, since: int) -> float:
    return engine_rate(engine_steps(server, user, since))


def test_a_borrower_alone_runs_like_an_unlimited_user(server):
    """Judged per scheduler step (tokens per step while all 8 streams are in
    the engine, the scheduler's part: the API server spreads their arrivals
    by more steps when the machine is loaded); the tok/s ratio, which a
    neighbour's load on two cores moves by a third between rounds, is
    printed beside it."""
    rates: dict[str, list[float]] = {"borrower": [], "free": []}
    per_step: dict[str, list[float]] = {"borrower": [], "free": []}
    start = time.monotonic_ns()
    for i in range(3):  # interleaved, alternating: the machine's drift hits both
        for user in ("borrower", "free") if i % 2 == 0 else ("free", "borrower"):
            since = time.monotonic_ns()
            # 300 tokens each: the API server can spread 8 arrivals over
            # ~100 steps on a loaded machine (seen in CI at 100 tokens).
            streams = run_concurrently(server.base_url, [(user, 8, 300)])
            assert_complete(streams)
            rates[user].append(_rate(server, user, since))
            steps, _, window, _ = _all_in(trace_steps(server, since), user, 8, 300)
            assert window >= 20, f"{user}'s 8 streams were all in for only {window} steps"
            per_step[user].append(steps)
    lines = trace_steps(server, start)
    borrowed = sum(r.get("borrowed", {}).get("borrower", 0) for r in lines)
    charged = sum(r.get("charged", {}).get("borrower", 0) for r in lines)
    ratio = statistics.median(rates["borrower"]) / statistics.median(rates["free"])
    step_ratio = statistics.median(per_step["borrower"]) / statistics.median(per_step["free"])
    print(
        f"8 streams: borrower {[round(r) for r in rates['borrower']]} tok/s, unlimited "
        f"{[round(r) for r in rates['free']]}: ratio {ratio:.2f}; tokens per step "
        f"{[round(r, 2) for r in per_step['borrower']]} and "
        f"{[round(r, 2) for r in per_step['free']]}: ratio {step_ratio:.2f}; {borrowed} of "
        f"{charged} of its tokens borrowed"
    )
    assert step_ratio >= 0.9
    assert borrowed >= 0.8 * charged  # its committed 20 tok/s is a small part of it


def test_the_peak_holds_in_every_window(server):
    since = time.monotonic_ns()
    streams = run_concurrently(server.base_url, [("peaky", 8, 60)])
    assert_complete(streams)
    steps = engine_steps(server, "peaky", since)
    excess = max_window_excess(steps, 100, BURST_NS)
    # The rate while its streams were all there: the last few streams of a
    # run finish alone, one token a step, slower than 100 tok/s when steps
    # are long (a loaded machine).
    total, seen, body = sum(k for _, k in steps), 0, steps
    for i, (_, k) in enumerate(steps):
        seen += k
        if seen >= 0.8 * total:
            body = steps[: i + 1]
            break
    rate = engine_rate(body)
    lines = [r for r in trace_steps(server, since) if r["t"] <= body[-1][0]]
    cap = 8 * step_rate(lines, "peaky")
    print(
        f"peaky (rate 20, peak 100): {rate:.1f} tok/s over its first 80% of tokens "
        f"({engine_rate(steps):.1f} in all; its steps allowed {cap:.0f}), worst window "
        f"{excess:+.2f}"
    )
    assert excess <= 1 + 1e-6  # (W + burst) * peak + 2
    assert rate >= 0.8 * min(100, cap)  # it did borrow: its committed rate alone is 20


def _engine_ttft_steps(server, user: str, since: int) -> list[int]:
    """The engine's own time to first token of `user`'s requests after
    `since`, in scheduler steps: each arrival (the step line after it reached
    the engine) to a first token, matched in order."""
    lines = trace_steps(server, since)
    arrived = [r["step"] for r in lines for _ in range(r.get("arrived", {}).get(user, 0))]
    first = [r["step"] for r in lines for _ in range(r.get("first", {}).get(user, 0))]
    return [f - a for a, f in zip(arrived, first, strict=False)]


@contextlib.contextmanager
def _borrowing(server, streams: int, tokens: int, settle_s: float) -> Iterator[int]:
    """The borrower's `streams` streams of `tokens` tokens in the background,
    the body entered `settle_s` after they came (the engine filled by
    then): yields when they came; every stream complete once the body is
    done."""
    hog: list = []
    t = threading.Thread(
        target=lambda: hog.extend(
            run_concurrently(server.base_url, [("borrower", streams, tokens)])
        )
    )
    t0 = time.monotonic_ns()
    t.start()
    try:
        time.sleep(settle_s)
        yield t0
    finally:
        t.join()
    assert_complete(hog)


def _steady_rate(server, user: str, since: int, skip: int = 20) -> float:
    """Engine tok/s after the first `skip` tokens (past the burst)."""
    steps = engine_steps(server, user, since)
    seen = 0
    for i, (_, k) in enumerate(steps):
        seen += k
        if seen >= skip:
            return engine_rate(steps[i:])
    return 0.0


def _all_in(
    lines: list[dict], user: str, streams: int, tokens: int, rate: float | None = None
) -> tuple[float, float, int, float]:
    """`user`'s tokens per scheduler step while all its `streams` were in the
    engine, the steps per second then, how many steps that was, and the
    tokens per step due in them: a token a stream, or (with a `rate`) what an
    exact GCRA limit at it grants at those steps' times, its bucket full at the
    user's first step (it arrives after a full burst's wait). From the step
    that gave the last stream its first token to `tokens - 1` steps after
    the first one's first token (no stream can have finished before: each
    needs `tokens - 1` more steps). Steps per second alone misstate what is
    due where the machine's speed moves within the play: at 98 steps/s on
    average a 100 tok/s user is held in the stretches that run faster than
    100/s (a fresh run: 0.87 tokens a step, due 1.00 by the mean)."""
    firsts = sorted(r["step"] for r in lines for _ in range(r.get("first", {}).get(user, 0)))
    assert len(firsts) == streams, firsts
    lo, hi = firsts[-1], firsts[0] + tokens - 1
    inside = [r for r in lines if lo <= r["step"] < hi]
    got = sum(
        r.get("charged", {}).get(user, 0) - r.get("refunded", {}).get(user, 0) for r in inside
    )
    if hi - lo < 2 or len(inside) < 2:
        return 0.0, 0.0, max(0, hi - lo), float(streams)
    per_s = (inside[-1]["step"] - inside[0]["step"]) / ((inside[-1]["t"] - inside[0]["t"]) / 1e9)
    if rate is None:
        return got / (hi - lo), per_s, hi - lo, float(streams)
    # Greedy GCRA grants the same on a prefix, so the grants in [lo, hi) are
    # those up to hi less those up to lo.
    times = [r["t"] for r in lines if firsts[0] <= r["step"] < hi]
    before = sum(1 for r in lines if firsts[0] <= r["step"] < lo)
    allowed = gcra_allowed(times, rate, BURST_NS, streams) - gcra_allowed(
        times[:before], rate, BURST_NS, streams
    )
    return got / (hi - lo), per_s, hi - lo, allowed / (hi - lo)


def _lone_step_rate(lines: list[dict], user: str) -> float:
    """Steps per second the machine made at the time with `user`'s work
    alone in them: their count over their summed length (the steps that
    charged `user` and nobody else, output or prompt tokens, each to the
    next step's line), NaN under 10 such steps.
    What `user` would get without borrowers, measured in the same seconds
    as what it got beside them: on two cores shared with another test lane
    the step length moves by a third between runs a few seconds apart. The
    mean, not the median: tok/s is one over the mean step, and the
    machine's stalls are in it (CI, brisk beside the borrower, nothing
    borrowed in its steps: its median lone step allowed 147 tok/s, it got
    130.6; here the mean lone step is 3-6% longer than the median)."""
    at = {r["step"]: r["t"] for r in lines}
    lengths = [
        at[r["step"] + 1] - r["t"]
        for r in lines
        if set(r.get("charged", {})) == {user}
        and set(r.get("prompt", {})) <= {user}
        and r["step"] + 1 in at
    ]
    return len(lengths) * 1e9 / sum(lengths) if len(lengths) >= 10 else float("nan")


def _due(rate: float, streams: int, lone: float, alone: float) -> float:
    """The tok/s a committed user is due beside borrowers: the least of its
    rate, what its streams get from the machine's lone steps in the same
    seconds (where enough were lone to tell), and its tok/s alone a few
    seconds before. The last two measure what the machine gives it without
    borrowers, each its own way: the lone steps miss the machine's stalls
    in the other steps (in one run brisk made 143 tok/s alone while its
    median lone step allowed 234), and a run a few seconds before misses
    how the load moved since (105 alone, then 78 beside at 78 steps/s). Borrowers that take
    its time leave it far under both: 0.48-0.63x with lending by slots."""
    due = min(rate, alone)
    return due if math.isnan(lone) else min(due, streams * lone)


ROOM = 1 / HEADROOM - 1
"""How far past its prediction a step may run with the rule's bound kept:
borrowers fill a step to HEADROOM of the longest every committed rate
allows (vllm_integration/step/steptime.py)."""


def _model_error(lines: list[dict], user: str) -> float:
    """How far the steps that charged `user` ran past the step model's
    prediction at their dispatch (the trace's `predicted_us`; a step's real
    length: to the next step's `t`), all together: sum of real lengths over
    sum of predicted, less 1. NaN without such a step."""
    at = {r["step"]: r["t"] for r in lines}
    real = predicted = 0
    for r in lines:
        if user in r.get("charged", {}) and "predicted_us" in r and r["step"] + 1 in at:
            real += at[r["step"] + 1] - r["t"]
            predicted += r["predicted_us"] * 1000
    return real / predicted - 1 if predicted else float("nan")


def _split_by_lending(lines: list[dict], user: str, lender: str) -> str:
    """`user`'s steps with and without `lender`'s borrowed tokens in them:
    how many, their mean length, and that over the step model's prediction
    at dispatch. Printed with the check, so that a failure says whether the
    lent steps ran past their prediction (the model's error) or the lone
    steps were long already (the machine)."""
    at = {r["step"]: r["t"] for r in lines}
    parts: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for r in lines:
        if user in r.get("charged", {}) and "predicted_us" in r and r["step"] + 1 in at:
            lent = bool(r.get("borrowed", {}).get(lender))
            parts[lent].append((at[r["step"] + 1] - r["t"], r["predicted_us"] * 1000))
    said = []
    for lent, name in ((True, "lent"), (False, "not lent")):
        if parts[lent]:
            real = sum(a for a, _ in parts[lent])
            predicted = sum(b for _, b in parts[lent])
            said.append(
                f"{len(parts[lent])} {name}, {real / len(parts[lent]) / 1e6:.2f} ms each, "
                f"{real / predicted - 1:+.0%} past the prediction"
            )
    return "; ".join(said) or "no step with a prediction"


def _run(server, user: str, streams: int, tokens: int) -> tuple:
    """Of `user`'s streams of `tokens` tokens: (engine tok/s past the burst,
    `_all_in`, engine time to first token p50 in steps, client time to first
    token p50 in seconds, `_lone_step_rate`, `_model_error`)."""
    since = time.monotonic_ns()
    done = run_concurrently(server.base_url, [(user, streams, tokens)])
    assert_complete(done)
    ttft = _engine_ttft_steps(server, user, since)
    assert len(ttft) == streams
    client = statistics.median(s.token_times[0] - s.started for s in done)
    lines = trace_steps(server, since)
    all_in = _all_in(lines, user, streams, tokens, COMMITTED[user])
    lone, error = _lone_step_rate(lines, user), _model_error(lines, user)
    return _steady_rate(server, user, since), all_in, statistics.median(ttft), client, lone, error


def _blind(out: tuple, rate: float, streams: int, alone: float) -> str | None:
    """Why a committed run beside the borrower (`_run`'s) that fell short of
    0.9x what it is due cannot judge the rule, or None: every step of it
    lent a token, so nothing measured what the machine gave it without
    borrowers in those seconds and its tok/s cannot be told from the load
    of another lane; or the machine stretched its steps past the step
    model's headroom, which the rule's bound assumes."""
    got, lone, error = out[0], out[4], out[5]
    if got >= 0.9 * _due(rate, streams, lone, alone) or not (math.isnan(lone) or error > ROOM):
        return None
    return (
        f"committed beside the borrower: {got:.1f} tok/s, lone steps at {lone:.0f}/s, "
        f"the steps {error:+.0%} past the step model's prediction"
    )


def test_a_committed_user_is_not_harmed_by_a_borrower(server):
    # roomy's 12 streams run 1,000 tokens: beside 48 streams on a loaded
    # machine the API server spread their arrivals over more than 150 steps
    # (of ~2 ms: roomy gets every step it asks for), and no step had all 12;
    # with 600, beside a one-core busy loop (2026-12-05), none again.
    runs = (("committed", 1, 150), ("roomy", ACTIVE, 1000))
    alone = {run: _run(server, *run) for run in runs}
    beside = {}
    with _borrowing(server, 3 * SEQS, 400, 2.0) as t0:
        for run in runs:
            user, n, _ = run

            def play(_: int) -> tuple:
                time.sleep(0.2)  # a full burst: within its committed rate as it starts
                return _run(server, *run)  # noqa: B023 (called within this iteration)

            if user == "committed":
                ra = alone[run][0]
                beside[run] = replay_once(play, lambda out: _blind(out, COMMITTED[user], n, ra))  # noqa: B023
            else:
                beside[run] = play(1)
    borrowed = sum(r.get("borrowed", {}).get("borrower", 0) for r in trace_steps(server, t0))
    assert borrowed > 0
    for (user, n, _), (ra, _, ta, ca, _, _), (rb, (sb, per_s, wb, due), tb, cb, lone, error) in zip(
        runs, alone.values(), beside.values(), strict=True
    ):
        print(
            f"{user}, {n} stream(s): {sb:.2f} tokens a step beside the borrower over the "
            f"{wb} steps all its streams were in, at {per_s:.0f} steps/s: due {due:.2f} (its "
            f"streams, or what an exact GCRA at its rate grants at those steps); engine "
            f"{ra:.1f} tok/s past the burst alone, {rb:.1f} beside; engine first token p50 "
            f"{ta:g} steps after arrival alone, "
            f"{tb:g} beside (client: {ca * 1000:.0f} / {cb * 1000:.0f} ms); steps with its "
            f"work alone beside the borrower ran at {lone:.0f}/s: due "
            f"{_due(COMMITTED[user], n, lone, ra):.1f} tok/s; its steps ran {error:+.1%} past "
            f"the step model's prediction"
        )
        # The scheduler's part: while all its streams are in, each step gives
        # it a token per stream, or as much as an exact GCRA at its committed
        # rate grants at those steps. Its tok/s is judged through that, not against its
        # tok/s alone: beside 48 borrowed streams each step is longer (a
        # fuller batch), and on two cores shared with the other test lane the
        # step length moves by a third between runs (in one CI run, 12
        # streams made 1,055 tok/s alone and 374 past the burst beside, while
        # the steps of that whole run allowed 549). A committed rate that the
        # engine can keep holds in tok/s too: asserted below for `committed`.
        assert wb >= 50, f"its streams were all in for only {wb} steps"
        assert sb >= 0.9 * due
        # Within its committed rate, a newcomer is scheduled in the step it
        # would be without the borrower: a borrower gives its seat back at once.
        assert tb <= ta + 1
        # Its rate in tokens per second (issue 40): borrowers spend only
        # step time it does not need, so it gets its rate, or what the
        # machine gives it without borrowers (`_due`).
        if user == "committed":
            assert rb >= 0.9 * _due(COMMITTED[user], n, lone, ra)


def test_an_unlimited_user_filling_every_slot_reclaims_them(server):
    with _borrowing(server, 4, 600, 1.5):  # borrowing by the body
        since = time.monotonic_ns()
        # 800 tokens a stream: its 12 requests reach the engine over a spread
        # of steps that load widens, and all 12 must run together (with 400,
        # beside a busy loop, 2026-12-05: no step had all 12).
        done = run_concurrently(server.base_url, [("free", ACTIVE, 800)])
    assert_complete(done)
    lines = trace_steps(server, since)
    counts = [r.get("charged", {}).get("free", 0) for r in lines]
    busy = [r for r, n in zip(lines, counts, strict=True) if n == ACTIVE]
    assert len(busy) >= 50, (
        f"{len(busy)} steps with all {ACTIVE} of the unlimited user's streams; at most "
        f"{max(counts, default=0)} in one step, over {len(lines)} steps"
    )
    first, last = busy[0]["t"], busy[-1]["t"]
    # While the unlimited user has every active slot (the stretch from its
    # first step with all 12 to its last).
    window = [r for r in lines if first <= r["t"] <= last]
    borrowed = sum(r.get("borrowed", {}).get("borrower", 0) for r in window)
    total = sum(r.get("borrowed", {}).get("borrower", 0) for r in lines)
    mine = [r for r in window if "borrower" in r.get("charged", {})]
    steps = [(r["t"], r["charged"]["borrower"]) for r in mine]
    excess = max_window_excess(steps, 20, BURST_NS) if steps else float("-inf")
    print(
        f"while the unlimited user held all {ACTIVE} active slots ({(last - first) / 1e9:.2f} "
        f"s, {len(busy)} of {len(window)} steps): the borrower got {sum(k for _, k in steps)} "
        f"tokens, {borrowed} borrowed ({total} in the whole run); worst window against its "
        f"committed 20 tok/s {excess:+.2f}"
    )
    assert len(busy) >= 0.8 * len(window)
    assert borrowed <= ACTIVE  # at most one step of borrowed tokens
    assert excess <= ACTIVE  # the committed bound plus that step


def _brisk_beside(server, skip: int) -> tuple[int, int, float, float, float]:
    """brisk's one stream of 300 tokens beside the borrower's 48: (when the
    borrower came, when brisk came, brisk's engine tok/s past `skip` tokens,
    `_lone_step_rate` and `_model_error` from then on)."""
    with _borrowing(server, 3 * SEQS, 200, 1.5) as t0:
        since = time.monotonic_ns()
        assert_complete(run_concurrently(server.base_url, [("brisk", 1, 300)]))
    lines = trace_steps(server, since)
    lone, error = _lone_step_rate(lines, "brisk"), _model_error(lines, "brisk")
    return t0, since, _steady_rate(server, "brisk", since, skip), lone, error


def test_a_committed_rate_holds_in_tokens_per_second(server):
    """Issue 40, on the engine's trace: `brisk`, one stream, committed to 0.7x
    what one unlimited stream runs alone right now, so that it gets its rate
    alone and a batch full of borrowers would make each step too long for
    it (on a fast phase of this machine a 12-stream step stays under
    `committed`'s 10 ms, and the check above cannot bite). Beside the
    borrower's 48 streams its engine tok/s past the burst is at least 0.9x
    alone: borrowers spend only the step time it does not need. The tok/s
    the borrower's full batch would allow (its step rate before brisk came)
    is printed: what lending by slots alone gave."""
    wait_idle(server)
    since = time.monotonic_ns()
    assert_complete(run_concurrently(server.base_url, [("free", 1, 150)]))
    rate = int(0.7 * _steady_rate(server, "free", since))
    use_policy(server, POLICY + f"  brisk: {rate}\n")
    skip = rate // 10 + 5  # its burst (100 ms) and a few
    try:
        since = time.monotonic_ns()
        assert_complete(run_concurrently(server.base_url, [("brisk", 1, 300)]))
        alone = _steady_rate(server, "brisk", since, skip)
        lone_alone = _lone_step_rate(trace_steps(server, since), "brisk")

        def past_the_model(out: tuple[int, int, float, float, float]) -> str | None:
            # The rule's bound assumes the step model within its headroom;
            # a machine that stretched the steps past it (a busy neighbour's
            # time slices) cannot judge the rule.
            got, lone, error = out[2:]
            if got >= 0.9 * _due(rate, 1, lone, alone) or not error > ROOM:
                return None
            return (
                f"brisk beside the borrower: {got:.1f} tok/s, the steps {error:+.0%} "
                f"past the step model's prediction (the rule's bound needs at most +{ROOM:.0%})"
            )

        played = replay_once(lambda _: _brisk_beside(server, skip), past_the_model)
        t0, since, beside, lone, error = played
    finally:
        use_policy(server, POLICY)
    lines = trace_steps(server, t0)
    full = step_rate([r for r in lines if r["t"] < since], "borrower")
    mine = [r for r in lines if "brisk" in r.get("charged", {})]
    lent = sum(r.get("borrowed", {}).get("borrower", 0) for r in mine)
    print(
        f"brisk {{rate: {rate}}}, one stream: engine {alone:.1f} tok/s past the burst alone, "
        f"{beside:.1f} beside the borrower's {3 * SEQS} streams ({beside / alone:.2f}x); "
        f"the borrower's full batch ran {full:.0f} steps/s; it borrowed {lent} tokens in "
        f"brisk's {len(mine)} steps, which ran {error:+.1%} past the step model's prediction; "
        f"steps with brisk's work alone ran at {lone_alone:.0f}/s "
        f"alone and {lone:.0f}/s beside: due {_due(rate, 1, lone, alone):.1f} tok/s beside; "
        f"its steps beside: {_split_by_lending(lines, 'brisk', 'borrower')}"
    )
    # Beside the borrower it gets its rate, or what the machine gives it
    # without borrowers (`_due`). (Alone it usually gets its rate: its rate
    # is 0.7x one unlimited stream's; printed, since the machine's load can
    # move that much between the two runs.)
    assert beside >= 0.9 * _due(rate, 1, lone, alone)
