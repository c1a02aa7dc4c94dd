"""The engine's counters on their way to /metrics (outrate/observe/publish.py):
what a `Metrics` with borrowed tokens, lends and reclaims renders, read back
from the text prometheus_client prints, and how data-parallel ranks add up.
No vLLM: the counts are set by hand, as the scheduler would have left them."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from outrate.observe.metrics import Metrics
from outrate.observe.publish import families, merge_snapshots, snapshot
from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.loader import parse_policy

POLICY = """\
version: 1
default: 10
tiers:
  free: {rate: 20, peak: 200}
users:
  alice: {rate: 20, peak: unlimited}
  bob: unlimited
  carol: 40
  peek: {rate: 5, peak: 7.5, shadow: true}
"""


def policy(text: str = POLICY) -> CompiledPolicy:
    return compile_policy(parse_policy(text, "t.yaml"), "t.yaml", "sha")


def page(data: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered page: (name, sorted labels) -> value."""

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            return families(data)

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def borrowing() -> Metrics:
    """alice borrowed 60 of her 100 tokens, peek would have borrowed 4 of 9;
    three held requests were lent a slot, one was reclaimed."""
    m = Metrics()
    for user in ("alice", "bob", "carol", "peek"):
        m.record(user)
    alice, peek = m.labels["alice"], m.labels["peek"]
    alice.tokens, alice.borrowed = 100, 60
    peek.tokens, peek.borrowed, peek.shadow_over = 9, 4, 2
    m.lent, m.reclaimed = 3, 1
    return m


def test_borrowed_tokens_lends_and_reclaims_render_with_their_values() -> None:
    samples = page(snapshot(borrowing(), policy(), now=0))
    borrowed = {
        dict(labels)["limit"]: v
        for (name, labels), v in samples.items()
        if name == "outrate_borrowed_tokens_total"
    }
    # every limit has the series, configured rules before their first request
    assert borrowed == {
        "alice": 60,
        "peek": 4,
        "bob": 0,
        "carol": 0,
        "default": 0,
        "anonymous": 0,
        "tier:free": 0,
    }
    assert samples["outrate_output_tokens_total", (("limit", "alice"),)] == 100  # borrowed inside
    assert samples["outrate_lent_total", ()] == 3
    assert samples["outrate_reclaimed_total", ()] == 1


def test_the_peak_is_a_sibling_gauge_equal_to_the_rate_where_there_is_none() -> None:
    samples = page(snapshot(borrowing(), policy(), now=0))

    def gauge(name: str) -> dict[tuple[str, str], float]:
        return {
            (dict(labels)["limit"], dict(labels)["mode"]): v
            for (n, labels), v in samples.items()
            if n == name
        }

    inf = math.inf
    assert gauge("outrate_limit_peak_tokens_per_second") == {
        ("alice", "enforce"): inf,  # peak: unlimited
        ("tier:free", "enforce"): 200,
        ("peek", "shadow"): 7.5,  # a shadow rule's peak, what it would allow
        ("carol", "enforce"): 40,  # no peak: the rate
        ("default", "enforce"): 10,
        ("anonymous", "enforce"): 10,
        ("bob", "enforce"): inf,  # unlimited rate: unlimited peak
    }
    rates = gauge("outrate_limit_tokens_per_second")
    assert rates.keys() == gauge("outrate_limit_peak_tokens_per_second").keys()
    assert rates[("alice", "enforce")] == 20 and rates[("peek", "shadow")] == 5


def test_a_label_the_policy_no_longer_has_gets_no_peak() -> None:
    m = borrowing()
    m.record("gone").borrowed = 5
    samples = page(snapshot(m, policy(), now=0))
    assert samples["outrate_borrowed_tokens_total", (("limit", "gone"),)] == 5
    assert not any(
        n == "outrate_limit_peak_tokens_per_second" and ("limit", "gone") in labels
        for n, labels in samples
    )


def test_data_parallel_ranks_add_their_borrowed_lent_and_reclaimed() -> None:
    pol = policy()
    one, two = borrowing(), borrowing()
    two.labels["alice"].borrowed = 7
    two.lent, two.reclaimed = 10, 20
    merged = merge_snapshots([snapshot(one, pol, now=0), snapshot(two, pol, now=0)])
    assert merged is not None
    assert merged["labels"]["alice"]["borrowed"] == 67
    assert merged["labels"]["alice"]["peak"] == -1  # a configured value, not a count
    assert merged["labels"]["tier:free"]["peak"] == 200
    assert (merged["lent"], merged["reclaimed"]) == (13, 21)


def test_a_snapshot_without_the_new_keys_still_renders() -> None:
    """A snapshot written before borrowing existed (a file left by an older
    engine) renders zeros, and merges, rather than failing the scrape."""
    data = snapshot(borrowing(), policy(), now=0)
    old = {k: v for k, v in data.items() if k not in ("lent", "reclaimed")}
    old["labels"] = {
        label: {k: v for k, v in row.items() if k not in ("borrowed", "peak")}
        for label, row in data["labels"].items()
    }
    samples = page(old)
    assert samples["outrate_borrowed_tokens_total", (("limit", "alice"),)] == 0
    assert samples["outrate_lent_total", ()] == 0
    assert not any(n == "outrate_limit_peak_tokens_per_second" for n, _ in samples)
    merged = merge_snapshots([old, data])
    assert merged is not None and merged["labels"]["alice"]["borrowed"] == 60


PROMPTS = """\
version: 1
default: {rate: 10, prompt: 500}
tiers:
  free: {rate: 20, prompt: {rate: 1000, burst: 1s}}
users:
  alice: {tier: free, prompt: unlimited}
  bob: 30
  peek: {rate: 5, shadow: true, prompt: 50}
"""


def test_prompt_tokens_and_prompt_rates_render_per_limit() -> None:
    m = Metrics()
    for user in ("alice", "bob", "peek"):
        m.record(user)
    m.labels["alice"].prompt, m.labels["bob"].prompt, m.labels["peek"].prompt = 1900, 40, 7
    m.deferred["prompt"] = 3
    samples = page(snapshot(m, policy(PROMPTS), now=0))
    counted = {
        dict(labels)["limit"]: v
        for (name, labels), v in samples.items()
        if name == "outrate_prompt_tokens_total"
    }
    assert counted == {
        "alice": 1900,
        "bob": 40,
        "peek": 7,
        "default": 0,
        "anonymous": 0,
        "tier:free": 0,
    }
    rates = {
        (dict(labels)["limit"], dict(labels)["mode"]): v
        for (name, labels), v in samples.items()
        if name == "outrate_limit_prompt_tokens_per_second"
    }
    assert rates == {
        ("alice", "enforce"): math.inf,  # prompt: unlimited overrides its tier's
        ("bob", "enforce"): math.inf,  # no prompt anywhere on its rule
        ("peek", "shadow"): 50,  # a shadow rule's prompt limit is shadow too
        ("default", "enforce"): 500,
        ("anonymous", "enforce"): 500,  # anonymous takes the default's
        ("tier:free", "enforce"): 1000,
    }
    assert samples["outrate_deferred_total", (("reason", "prompt"),)] == 3


def test_data_parallel_ranks_add_their_prompt_tokens() -> None:
    pol = policy(PROMPTS)
    one, two = Metrics(), Metrics()
    one.record("bob").prompt, two.record("bob").prompt = 40, 60
    merged = merge_snapshots([snapshot(one, pol, now=0), snapshot(two, pol, now=0)])
    assert merged is not None
    assert merged["labels"]["bob"]["prompt"] == 100
    assert merged["labels"]["default"]["prompt_rate"] == 500  # a configured value, not a count


def test_prompt_waits_and_shadow_over_render_per_limit_and_add_up_across_ranks() -> None:
    """Requests waiting for prompt budget (a gauge), waits started and prompt
    tokens over a shadow prompt limit (counters), per limit; an engine from
    before these counts renders 0."""
    pol = policy(PROMPTS)
    one, two = Metrics(), Metrics()
    bob, peek = one.record("bob"), one.record("peek")
    bob.prompt_waiting, bob.prompt_waits, peek.prompt_over = 2, 5, 30
    two.record("bob").prompt_waits = 1
    samples = page(snapshot(one, pol, now=0))
    for name, want in (
        ("outrate_prompt_waiting_requests", {"bob": 2}),
        ("outrate_prompt_waits_total", {"bob": 5}),
        ("outrate_prompt_shadow_over_tokens_total", {"peek": 30}),
    ):
        got = {dict(ls)["limit"]: v for (n, ls), v in samples.items() if n == name}
        assert got == {
            **dict.fromkeys(("bob", "peek", "default", "anonymous", "tier:free"), 0),
            **want,
        }
    merged = merge_snapshots([snapshot(one, pol, now=0), snapshot(two, pol, now=0)])
    assert merged is not None
    assert merged["labels"]["bob"]["prompt_waits"] == 6
    assert merged["labels"]["bob"]["prompt_waiting"] == 2
    old = snapshot(one, pol, now=0)
    for row in old["labels"].values():
        for k in ("prompt_over", "prompt_waiting", "prompt_waits"):
            del row[k]
    assert page(old)["outrate_prompt_waits_total", (("limit", "bob"),)] == 0


def test_quota_usage_per_label_with_the_series_cap() -> None:
    """A listed user is its own label; opted-in users with a series too, and
    past `metrics.max_series` (or before their first request) `other`;
    everyone else under the rule's label, summed, with how many are spent.
    Only the quotas in force are shown, and a rule's from the start."""
    from outrate.budget.quota import QuotaBook
    from outrate.observe.quotas import quota_usage

    pol = compile_policy(
        parse_policy(
            "version: 1\n"
            "default: {rate: 10, quota: {output: 100/day}}\n"
            "tiers:\n  t: {rate: 10, quota: {prompt: 5K/hour}}\n"
            "users:\n  alice: {tier: t}\n  quiet: {tier: t}\n"
            "metrics: {per_user: ['team-*'], max_series: 1}\n",
            "t.yaml",
        ),
        "t.yaml",
    )
    book = QuotaBook(clock=lambda: 1_796_378_400.0)
    book.add("alice", "prompt", 700, ["hour"])
    book.add("alice", "output", 9, ["day"])  # counted (some rule has it), not her quota
    for user, n in (("team-a", 120), ("team-b", 30), ("team-c", 100), ("zed", 40)):
        book.add(user, "output", n, ["day"])
    metrics = Metrics()
    metrics.label_of("team-a", pol)  # the one series the cap allows
    rows = quota_usage(book, metrics, pol)
    assert rows["alice"] == {"prompt/hour": {"used": 700, "spent": 0, "quota": 5000}}
    assert "quiet" not in rows  # a listed user shows from its first request, as for tokens
    assert rows["team-a"] == {"output/day": {"used": 120, "spent": 1, "quota": 100}}
    assert rows["other"] == {"output/day": {"used": 130, "spent": 1}}  # no one rule
    assert rows["default"] == {"output/day": {"used": 40, "spent": 0, "quota": 100}}
    assert rows["tier:t"] == {"prompt/hour": {"used": 0, "spent": 0, "quota": 5000}}
    assert metrics.n_series == 1  # reading never handed out a series
    data = snapshot(metrics, pol, quota=rows)
    samples = page(data)

    def at(name: str, limit: str, kind: str, window: str) -> float | None:
        labels = (("kind", kind), ("limit", limit), ("window", window))
        return samples.get((name, labels))

    assert at("outrate_quota_used_tokens", "other", "output", "day") == 130
    assert at("outrate_quota_spent_users", "team-a", "output", "day") == 1
    assert at("outrate_quota_tokens", "tier:t", "prompt", "hour") == 5000
    assert at("outrate_quota_tokens", "other", "output", "day") is None
    merged = merge_snapshots([data, snapshot(metrics, pol, quota=rows)])
    assert merged is not None and merged["quota"]["default"]["output/day"]["used"] == 80


def test_quota_gauges_read_the_book_at_most_every_interval() -> None:
    """A pass over the book is O(users): the publisher (twice a second)
    reuses the last one for `interval_s`, but not across a policy swap."""
    from outrate.budget.quota import QuotaBook
    from outrate.observe.quotas import QuotaGauges

    text = "version: 1\ndefault: {rate: 10, quota: {output: 100/day}}\n"
    pol = compile_policy(parse_policy(text, "t.yaml"), "t.yaml")
    book = QuotaBook(clock=lambda: 1_796_378_400.0)
    now = [0.0]
    gauges = QuotaGauges(book, interval_s=5.0, clock=lambda: now[0])
    metrics = Metrics()
    book.add("zed", "output", 7, ["day"])
    assert gauges.rows(metrics, pol)["default"]["output/day"]["used"] == 7
    book.add("zed", "output", 3, ["day"])
    now[0] = 4.9
    assert gauges.rows(metrics, pol)["default"]["output/day"]["used"] == 7  # the last pass
    now[0] = 5.0
    assert gauges.rows(metrics, pol)["default"]["output/day"]["used"] == 10
    swapped = compile_policy(parse_policy(text, "t.yaml"), "t.yaml")
    book.add("zed", "output", 1, ["day"])
    assert gauges.rows(metrics, swapped)["default"]["output/day"]["used"] == 11
    assert gauges.passes == 3
