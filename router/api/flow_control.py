"""Flow control at the ingress: priorities, per-tenant fair queueing and quotas.

A request admitted by the ingress (router/api/admission.py bounds how many it holds) passes `FlowControl.enter`
before it is placed. While the cluster has room (`FlowConfig.max_in_flight` not reached, the router not
saturated, and the request, placed now, would not just wait for a prefill slot) it goes on at once;
otherwise it waits in a `FairQueue`, and requests leave that queue by rule as room frees up, one at a time:
the next goes once the last is placed, since the workers' loads (the saturation signal) show a request only
from then on. So the queues past the ingress stay short, and the order that matters is this one (but for a
request whose first token would come in a fraction of the held-back head's time: it goes past, `_quick_past`):

- priority first (vLLM's meaning: lower runs first, default 0), in whole bands; a queued request's priority
  improves by one every `aging_s` seconds, so none waits forever behind a stream of urgent ones;
- within a band, tenants share by weight: start-time fair queueing on each request's predicted tokens (prompt +
  max_tokens), so a tenant sending long prompts does not get more than its share by sending fewer, and a
  quiet tenant's request goes next rather than after a burst of the flood's;
- within a tenant, priority then arrival.

Quotas per tenant (`TenantPolicy`): requests in flight at once (the rest queue), requests queued (beyond it,
429), and prompt + output tokens per minute (a token bucket charged with the prompt and max_tokens when the
request is let in, refunded by what it did not generate; a request the bucket cannot cover now gets 429 with
a Retry-After at which it can). A client that leaves while queued is removed at once (`enter` is cancelled).
With several ingress replicas, tokens per minute and max_concurrent are counted cluster-wide: each replica
leases them from one ledger (router/api/quota_ledger.py); max_queued and max_in_flight stay per replica.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from router.api.openai_api import APIError
from router.api.quota_ledger import LedgerUnavailable, SharedQuotas
from router.placement.calibration import PredictionErrors

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # requests without an API key, and tenants the config does not name
SHED_MODES = ("off", "on", "low_priority")
WATCH_POLL_S = 0.05  # while requests queue, how often the gate looks again at least
# A queued request whose first token, placed now, comes within this share of the time the request at the head
# of the queue (held back: it would wait for a prefill slot, or the router is saturated) would take goes on past
# it (`FlowControl._quick_past`); among the first QUICK_SCAN of its band, looked at every QUICK_SCAN_S at most.
QUICK_SHARE = 0.25
QUICK_SCAN = 8
QUICK_SCAN_S = 0.1
STUCK_WARN_S = 10.0  # a queue that lets nothing on for this long says why in the log


@dataclass(slots=True)
class TenantPolicy:
    """One tenant's share and limits; None: no limit."""
    weight: float = 1.0
    max_concurrent: int | None = None  # requests placed on workers at once; beyond it they queue
    max_queued: int | None = None  # requests waiting in the ingress queue; beyond it, 429
    tokens_per_minute: int | None = None  # prompt + output tokens; beyond it, 429 with Retry-After
    max_priority: int | None = None  # the most urgent priority (the smallest number) its requests may ask for

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight}")
        for name in ("max_concurrent", "max_queued", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or null, got {value!r}")
        if self.max_priority is not None and (not isinstance(self.max_priority, int)
                                              or isinstance(self.max_priority, bool)):
            raise ValueError(f"max_priority must be an integer or null, got {self.max_priority!r}")


@dataclass(slots=True)
class FlowConfig:
    """The ingress's queue discipline (ClusterConfig `flow:` and `tenants:`)."""
    max_in_flight: int | None = None  # requests placed at once by this ingress replica; None: the router decides
    aging_s: float = 10.0  # a queued request's priority improves by one per aging_s seconds waited
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    default_tenant: TenantPolicy = field(default_factory=TenantPolicy)  # any tenant not named in `tenants`
    # SLO-aware shedding: "on" refuses (503) a request whose predicted first token comes after its deadline,
    # "low_priority" only those of priority > 0; the deadline is X-Tandem-Deadline-Ms, else `deadline_s`.
    shed: str = "off"
    deadline_s: float | None = None
    # The share of admitted requests whose first token shedding means to be in time: a prediction counts
    # scaled by this quantile of the measured first token ÷ its prediction (`PredictionErrors`); null: as is.
    shed_quantile: float | None = 0.9

    def __post_init__(self):
        if self.shed not in SHED_MODES:
            raise ValueError(f"shed must be one of {', '.join(SHED_MODES)}, got {self.shed!r}")
        if self.shed_quantile is not None and not 0.5 <= self.shed_quantile < 1:
            raise ValueError(f"shed_quantile must be in [0.5, 1) or null, got {self.shed_quantile!r}")
        if self.max_in_flight is not None and (not isinstance(self.max_in_flight, int) or self.max_in_flight < 1):
            raise ValueError(f"max_in_flight must be a positive integer or null, got {self.max_in_flight!r}")
        if not self.aging_s > 0:
            raise ValueError(f"aging_s must be > 0, got {self.aging_s}")

    def policy(self, tenant: str) -> TenantPolicy:
        return self.tenants.get(tenant, self.default_tenant)


@dataclass(slots=True, eq=False)
class Entry:
    """One queued request."""
    tenant: str
    priority: int
    cost: int  # predicted tokens: the fair queue's unit
    enqueued_at: float
    seq: int
    granted: asyncio.Future | None = None
    prompt_tokens: int = 0
    ready: Callable[[], bool] | None = None  # False while the request, placed now, would only wait for a slot
    # Its first token's predicted seconds from arrival, placed now behind (requests, prompt tokens) queued here
    predict: Callable[[tuple[int, int]], float | None] | None = None

    def effective_priority(self, now: float, aging_s: float) -> int:
        return self.priority - int((now - self.enqueued_at) / aging_s)


class TokenBucket:
    """Tokens per minute: holds up to one minute's worth, refilled continuously."""

    def __init__(self, per_minute: int, clock: Callable[[], float]):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.clock = clock
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def take(self, tokens: int) -> float:
        """Take `tokens` and return 0, or take nothing and return the seconds until they are there."""
        self._refill()
        if self.level >= tokens:
            self.level -= tokens
            return 0.0
        return (tokens - self.level) / self.rate

    def give_back(self, tokens: int) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + tokens)


class _TenantQueue:
    __slots__ = ("name", "weight", "entries", "finish")

    def __init__(self, name: str, weight: float, finish: float):
        self.name, self.weight = name, weight
        self.entries: list[Entry] = []
        self.finish = finish  # virtual time at which its last request served would end its share

    def head(self, now: float, aging_s: float) -> Entry:
        return min(self.entries, key=lambda e: (e.effective_priority(now, aging_s), e.seq))


class FairQueue:
    """Priority bands (with aging), then start-time fair queueing across tenants by weight on predicted
    tokens (Goyal, Vin and Cheng, SIGCOMM 1996). `pop(now, eligible)` takes the next entry among tenants
    `eligible` allows (a tenant at its concurrency cap waits).

    Each tenant's next request starts at virtual time max(V, the tenant's last finish) and finishes its
    cost / weight later; the contender that starts first goes, and V moves to its start. A backlogged
    tenant's starts run ahead of V by what it has been served; a tenant that was idle starts at V, so its
    request goes next, not after a round of the flood's (the burst deficit round robin lets through), and
    banks no credit for its idle time. Over a long run each backlogged tenant gets tokens in proportion to
    its weight."""

    def __init__(self, aging_s: float = 10.0):
        self.aging_s = aging_s
        self.tenants: dict[str, _TenantQueue] = {}
        self.virtual = 0.0  # V: the start tag of the last request popped
        self._finish: dict[str, float] = {}  # last finish tags of tenants with nothing queued, while ahead of V
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self.tenants.values())

    def queued(self, tenant: str) -> int:
        t = self.tenants.get(tenant)
        return len(t.entries) if t else 0

    def ahead_of(self, priority: int, now: float) -> tuple[int, int]:
        """(requests, prompt tokens) queued in `priority`'s band or a more urgent one: those that go first."""
        ahead = [e for t in self.tenants.values() for e in t.entries
                 if e.effective_priority(now, self.aging_s) <= priority]
        return len(ahead), sum(e.prompt_tokens for e in ahead)

    def push(self, tenant: str, priority: int, cost: int, now: float, weight: float = 1.0) -> Entry:
        entry = Entry(tenant, priority, max(1, cost), now, next(self._seq))
        t = self.tenants.get(tenant)
        if t is None:
            t = self.tenants[tenant] = _TenantQueue(tenant, weight, self._finish.pop(tenant, 0.0))
        t.weight = weight
        t.entries.append(entry)
        return entry

    def remove(self, entry: Entry) -> None:
        t = self.tenants.get(entry.tenant)
        if t is None or entry not in t.entries:
            return
        t.entries.remove(entry)
        if not t.entries:
            self._drop(t)

    def _drop(self, t: _TenantQueue) -> None:
        del self.tenants[t.name]
        if t.finish > self.virtual:  # what it was served lately still counts when it comes back soon
            self._finish[t.name] = t.finish
        self._finish = {name: f for name, f in self._finish.items() if f > self.virtual}

    def start(self, t: _TenantQueue) -> float:
        return max(self.virtual, t.finish)

    def peek(self, now: float, eligible: Callable[[str], bool] = lambda tenant: True) -> Entry | None:
        """The entry `pop` would take now, left in the queue."""
        heads = {name: t.head(now, self.aging_s) for name, t in self.tenants.items() if eligible(name)}
        if not heads:
            return None
        band = min(e.effective_priority(now, self.aging_s) for e in heads.values())
        name = min((n for n, e in heads.items() if e.effective_priority(now, self.aging_s) == band),
                   key=lambda n: (self.start(self.tenants[n]), heads[n].seq))
        return heads[name]

    def pop(self, now: float, eligible: Callable[[str], bool] = lambda tenant: True) -> Entry | None:
        entry = self.peek(now, eligible)
        return None if entry is None else self.take(entry)

    def take(self, entry: Entry) -> Entry:
        """Serve `entry`, the one `peek` chose: the virtual time moves to its tenant's start."""
        t = self.tenants[entry.tenant]
        self.virtual = self.start(t)
        t.finish = self.virtual + entry.cost / t.weight
        t.entries.remove(entry)
        if not t.entries:
            self._drop(t)
        return entry


class Grant:
    """A request let through flow control. Until it is placed on workers, their loads do not show it, so
    the gate lets nothing else through meanwhile: `placements(n)` gives the callback its n placements
    (one per prompt or candidate run) each call once made. `release(output_tokens)` when it ends
    (idempotent; it counts as placed then too): the tokens it generated, so that its tenant's budget gets
    back the rest of its max_tokens (None: keep the charge)."""

    __slots__ = ("flow", "tenant", "priority", "charged", "max_output", "released", "unplaced", "ahead", "prefilled",
                 "predicted_s")

    def __init__(self, flow: FlowControl, tenant: str, charged: int, max_output: int, priority: int = 0):
        self.flow, self.tenant, self.charged, self.max_output = flow, tenant, charged, max_output
        self.priority = priority
        self.released = False
        self.ahead = False  # let on ahead of the prompts queued on workers (`FlowControl._may_go_ahead`)
        self.unplaced = 0  # placements still to be made; > 0 only while the grant counts in flow.placing
        # Whether every prompt of the request has its first token (set by the caller once it has candidates);
        # until then the request counts as prompt work in flight (`FlowControl._urgent_may_go`).
        self.prefilled: Callable[[], bool] = lambda: False
        self.predicted_s: float | None = None  # its first token's predicted seconds from arrival, when shed by it

    def placements(self, n: int) -> Callable[[], None]:
        self.unplaced = n

        def placed() -> None:
            if self.unplaced > 0:
                self.unplaced -= 1
                if not self.unplaced:
                    self.flow._placed()
        return placed

    def release(self, output_tokens: int | None = None, ttft_s: float | None = None) -> None:
        """`ttft_s`: its (slowest prompt's) first token's seconds from arrival, None without one."""
        if self.released:
            return
        self.released = True
        if self.predicted_s is not None and ttft_s is not None:
            self.flow.prediction_errors.observe(self.predicted_s, ttft_s)
        if self.unplaced:
            self.unplaced = 0
            self.flow._placed(pump=False)
        self.flow._leave(self, None if output_tokens is None else max(0, self.max_output - output_tokens))


def _remaining_s(entry: Entry, now: float) -> float | None:
    """The queued request's predicted seconds from now to its first token, were it placed now."""
    predicted = entry.predict((0, 0))
    return None if predicted is None else max(0.0, predicted - (now - entry.enqueued_at))


class FlowControl:
    """The ingress's gate: `enter` returns a Grant at once, after waiting its turn, or raises 429 / 400."""

    def __init__(self, config: FlowConfig | None = None, saturated: Callable[[], bool] = lambda: False,
                 metrics=None, clock: Callable[[], float] = time.monotonic,
                 wait_for_loads: Callable[[float], Awaitable[None]] | None = None,
                 shared: SharedQuotas | None = None):
        self.config = config or FlowConfig()
        self.shared = shared  # the cluster-wide quotas, with several ingress replicas; None: counted here
        self.saturated = saturated  # the router's word: placing more now only queues them on workers
        self.wait_for_loads = wait_for_loads
        self._watcher: asyncio.Task | None = None
        self.metrics = metrics  # router/metrics.py FlowMetrics, or None
        self.clock = clock
        self.queue = FairQueue(self.config.aging_s)
        self.in_flight = 0
        self.placing = 0  # grants let through and not placed yet: the router's saturation does not show them
        self.last_start = self.clock()  # when the last request was let through
        self.running: dict[str, int] = {}  # per tenant
        self.grants: set[Grant] = set()  # the requests let through and not released
        self.buckets: dict[str, TokenBucket] = {}
        # Of the requests shedding admitted. Admitting at the prediction itself put half of them just past a 2 s
        # deadline at twice the knee (TTFT p50 1.9 s), since the prediction misses what arrives after it was made;
        # at the knee, where it overstated, the factor falls below 1 and sheds less.
        self.prediction_errors = PredictionErrors()
        self._quick_looked = -math.inf  # when `_quick_past` last looked

    def snapshot(self) -> dict:
        """This replica's queue for `tandem status`: requests placed, whether the router is saturated, and per
        tenant its requests running and queued."""
        tenants = sorted(set(self.running) | set(self.queue.tenants))
        return {"in_flight": self.in_flight, "placing": self.placing, "max_in_flight": self.config.max_in_flight,
                "saturated": self.saturated(), "shed": self.config.shed,
                "tenants": {t: {"running": self.running.get(t, 0), "queued": self.queue.queued(t),
                                "weight": self.weight(t)} for t in tenants}}

    def weight(self, tenant: str | None) -> float:
        return self.config.policy(tenant or DEFAULT_TENANT).weight

    def check_priority(self, tenant: str | None, priority: int) -> None:
        """400 when the tenant's key may not ask for `priority`."""
        policy = self.config.policy(tenant or DEFAULT_TENANT)
        if policy.max_priority is not None and priority < policy.max_priority:
            raise APIError.bad_request(f"priority {priority} is more urgent than this API key may ask for "
                                       f"(at most {policy.max_priority}; lower runs first)", "priority")

    async def enter(self, tenant: str | None, priority: int, prompt_tokens: int, max_output: int,
                    deadline_s: float | None = None,
                    predict: Callable[[tuple[int, int]], float | None] | None = None,
                    ready: Callable[[], bool] | None = None) -> Grant:
        """Let a request in: shed it (503) when shedding applies and `predict` (seconds to its first token
        from arrival, given the (requests, prompt tokens) queued here before it) says it will miss its deadline;
        charge its tenant's token budget (429 when short); then place it now if there is room, nobody waits
        and it is `ready()` (placed now, it would not just wait for a prefill slot), else queue it (429 past
        the tenant's max_queued) and return when the fair queue picks it and it is ready."""
        tenant = tenant or DEFAULT_TENANT
        policy = self.config.policy(tenant)
        self.check_priority(tenant, priority)
        predicted = self._shed(tenant, priority, deadline_s, predict)
        cost = prompt_tokens + max_output
        if policy.tokens_per_minute is not None:
            if cost > policy.tokens_per_minute:
                raise APIError.bad_request(
                    f"the request may use {cost} tokens (prompt {prompt_tokens} + max_tokens {max_output}), more "
                    f"than tenant {tenant!r} may use in a minute ({policy.tokens_per_minute}); lower max_tokens",
                    "max_tokens")
            wait_s = await self._take_tokens(tenant, priority, policy.tokens_per_minute, cost)
            if wait_s:
                self._refused(tenant, priority, "tokens_per_minute")
                retry = max(1, math.ceil(wait_s))
                raise APIError(429, f"tenant {tenant!r} is over its {policy.tokens_per_minute} tokens per minute; "
                                    f"this request's {cost} tokens are there in {retry}s",
                               type="rate_limit_exceeded", code="rate_limit_exceeded",
                               headers={"Retry-After": str(retry)})
        grant = Grant(self, tenant, cost if policy.tokens_per_minute is not None else 0, max_output, priority)
        grant.predicted_s = predicted
        try:
            if (not self.queue.queued(tenant) and self._may_go_ahead(tenant)
                    or not self.queue.ahead_of(priority, self.clock())[0] and self._urgent_may_go(tenant, priority)):
                self._start(tenant, priority, 0.0, ahead=True)
                grant.unplaced, grant.ahead = 1, True
                self.grants.add(grant)
                return grant
            if not len(self.queue) and self._has_room(tenant) and (ready is None or ready()):
                self._start(tenant, priority, 0.0)
                grant.unplaced = 1
                self.grants.add(grant)
                return grant
            if policy.max_queued is not None and self.queue.queued(tenant) >= policy.max_queued:
                self._refused(tenant, priority, "max_queued")
                raise APIError(429, f"tenant {tenant!r} has {policy.max_queued} requests queued, its limit; "
                                    f"retry after 1s", type="rate_limit_exceeded", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
            entry = self.queue.push(tenant, priority, cost, self.clock(), policy.weight)
            entry.prompt_tokens, entry.ready, entry.predict = prompt_tokens, ready, predict
            entry.granted = asyncio.get_running_loop().create_future()
            self._observe_queue()
            self.pump()
            self._lease_slots(tenant)
            self._watch()
            try:
                grant.ahead = await entry.granted
            except asyncio.CancelledError:
                if entry.granted.done() and not entry.granted.cancelled():
                    self._placed(pump=False)  # granted as the client left: give the room back
                    self._finish(tenant)
                    self.pump()
                    self._trim_slots(tenant)
                else:
                    self.queue.remove(entry)
                    self._observe_queue()
                    self._trim_slots(tenant)
                    if self.metrics is not None:
                        self.metrics.cancelled.labels(tenant).inc()
                raise
            grant.unplaced = 1
            self.grants.add(grant)
            return grant
        except BaseException:
            self._refund(grant, grant.charged)  # it never ran
            raise

    async def _take_tokens(self, tenant: str, priority: int, per_minute: int, cost: int) -> float:
        """Charge `cost` to the tenant's budget: 0, or the seconds until it can be (nothing charged)."""
        if self.shared is None:
            bucket = self.buckets.get(tenant)
            if bucket is None:
                bucket = self.buckets[tenant] = TokenBucket(per_minute, self.clock)
            return bucket.take(cost)
        try:
            return await self.shared.take_tokens(tenant, per_minute, cost)
        except LedgerUnavailable as exc:
            self._refused(tenant, priority, "ledger")
            raise self._ledger_error(tenant, exc) from exc

    @staticmethod
    def _ledger_error(tenant: str, exc: Exception) -> APIError:
        return APIError(503, f"tenant {tenant!r}'s quota cannot be checked now ({exc}); retry after 1s",
                        type="service_unavailable", code="quota_ledger_unavailable", headers={"Retry-After": "1"})

    def _lease_slots(self, tenant: str) -> None:
        """With shared quotas, lease slots for the tenant's queued requests from the ledger (each lease lets
        the queue pump); if the ledger does not answer, its queued requests get 503."""
        cap = self.config.policy(tenant).max_concurrent
        if self.shared is None or cap is None:
            return

        def needed() -> int:
            return self.running.get(tenant, 0) + self.queue.queued(tenant)

        if self.shared.held.get(tenant, 0) < needed():
            self.shared.want_slot(tenant, cap, needed, self.pump, lambda exc: self._fail_queued(tenant, exc))

    def _trim_slots(self, tenant: str) -> None:
        if self.shared is not None and self.config.policy(tenant).max_concurrent is not None:
            self.shared.trim(tenant, self.running.get(tenant, 0) + self.queue.queued(tenant))

    def _fail_queued(self, tenant: str, exc: Exception) -> None:
        """The ledger did not answer while the tenant's requests waited for slots: they get 503 now."""
        t = self.queue.tenants.get(tenant)
        for entry in list(t.entries) if t is not None else []:
            self.queue.remove(entry)
            if entry.granted is not None and not entry.granted.done():
                self._refused(tenant, entry.priority, "ledger")
                entry.granted.set_exception(self._ledger_error(tenant, exc))
        self._observe_queue()

    def _shed(self, tenant: str, priority: int, deadline_s: float | None, predict) -> float | None:
        """503 + Retry-After when shedding applies to the request and its first token is predicted after its
        deadline: refused at once rather than queued to miss it. Requests already admitted are never shed. The
        prediction counts scaled by how far off the admitted ones' were (`PredictionErrors`, at
        `shed_quantile`). Returns the prediction of a request it admitted (None: not predicted)."""
        mode = self.config.shed
        if mode == "off" or (mode == "low_priority" and priority <= 0) or predict is None:
            return None
        deadline = deadline_s if deadline_s is not None else self.config.deadline_s
        if deadline is None:
            return None
        predicted = predict(self.queue.ahead_of(priority, self.clock()))
        if predicted is None:
            return None
        factor = self.prediction_errors.factor(self.config.shed_quantile)
        if self.metrics is not None:
            self.metrics.shed_factor.set(factor)
        expected = predicted * factor
        if expected <= deadline:
            return predicted
        self._refused(tenant, priority, "shed")
        retry = max(1, math.ceil(expected - deadline))
        scaled = f" ({predicted:.2f}s predicted, x{factor:.2f} as the admitted ones' came)" if factor != 1 else ""
        raise APIError(503, f"the first token is expected in {expected:.2f}s{scaled}, after this request's deadline "
                            f"of {deadline:.2f}s; refused rather than queued to miss it (retry after {retry}s)",
                       type="service_unavailable", code="deadline_unmeetable", headers={"Retry-After": str(retry)})

    def pump(self) -> None:
        """Start queued requests while there is room, in the fair queue's order; the next in that order that
        is not ready (it would only wait for a prefill slot) holds the rest back, unless its tenant is behind
        its share or it is more urgent than every request in flight: then it goes on at once, ahead of the prompts
        queued on workers (`_may_go_ahead`, `_urgent_may_go`)."""
        while len(self.queue):
            now = self.clock()
            behind = [t for t in self.queue.tenants if self._may_go_ahead(t)]
            entry = (self.queue.tenants[behind[0]].head(now, self.queue.aging_s) if behind
                     else self.queue.peek(now, self._tenant_has_room))
            if entry is not None and entry.granted is not None and entry.granted.done():
                # Its client left: the waiter was cancelled and will count it once it runs; it takes no room.
                self.queue.remove(entry)
                continue
            if entry is None:
                break
            ahead = bool(behind) or self._urgent_may_go(entry.tenant, entry.priority)
            if not ahead and not (self._room() and (entry.ready is None or entry.ready())):
                entry = self._quick_past(entry, now)
                if entry is None:
                    break
                if self.metrics is not None:
                    self.metrics.quick.labels(entry.tenant).inc()
            self.queue.take(entry)
            self._start(entry.tenant, entry.priority, self.clock() - entry.enqueued_at, ahead)
            entry.granted.set_result(ahead)
        self._observe_queue()

    def _quick_past(self, head: Entry, now: float) -> Entry | None:
        """A request of the head's band, queued behind the held-back head, that goes on past it: placed now, it
        would not wait for a prefill slot, and its first token would come within QUICK_SHARE of the time the head's
        would take (a prefix hit or a short prompt behind a long cold one: the shortest first, where the head would
        only wait). The head keeps its place. One at a time (the gate free), among the first QUICK_SCAN of the band
        by arrival, looked for every QUICK_SCAN_S at most (each look is two placement previews a request)."""
        if head.predict is None or now - self._quick_looked < QUICK_SCAN_S or not self._gate_free(head.tenant):
            return None
        self._quick_looked = now
        band = head.effective_priority(now, self.queue.aging_s)
        behind = sorted((e for t in self.queue.tenants.values() for e in t.entries
                         if e is not head and e.predict is not None and e.ready is not None
                         and e.effective_priority(now, self.queue.aging_s) == band
                         and not (e.granted is not None and e.granted.done()) and self._tenant_has_room(e.tenant)),
                        key=lambda e: e.seq)[:QUICK_SCAN]
        if not behind:
            return None
        try:
            head_s = _remaining_s(head, now)
            if head_s is None:
                return None
            for entry in behind:
                entry_s = _remaining_s(entry, now)
                if entry_s is not None and entry_s <= QUICK_SHARE * head_s and entry.ready():
                    return entry
        except Exception:  # a bug in a prediction; `enter` and `release` pump too and must not fail for it
            logger.exception("the ingress queue could not predict its requests' first tokens")
            if self.metrics is not None:
                self.metrics.pump_errors.inc()
        return None

    def _may_go_ahead(self, tenant: str) -> bool:
        """Whether a request of `tenant` goes on now whatever the router's saturation, ahead of the prompts of its
        priority queued on workers: its tenant has fewer requests running, by weight, than every other tenant
        with requests running or queued (so it is served below its share while they are not), and the gate is
        free (nothing unplaced, below max_in_flight, the tenant below its own cap). Each such start brings the
        tenant nearer its share, so a tenant goes ahead only until it has caught up."""
        if not self._gate_free(tenant):
            return False
        mine = self.running.get(tenant, 0) / self.weight(tenant)
        others = [self.running.get(t, 0) / self.weight(t) for t in set(self.running) | set(self.queue.tenants)
                  if t != tenant and (self.running.get(t, 0) or self.queue.queued(t))]
        return bool(others) and mine < min(others)

    def _urgent_may_go(self, tenant: str, priority: int) -> bool:
        """Whether a request of `priority` (nothing queued before it) goes on now whatever the router's saturation,
        ahead of the prompts queued on workers: less urgent requests are in flight here and no request of its
        priority or a more urgent one is still waiting for its first token, so the workers would compute it first
        anyway, and waiting at the ingress for a prefill slot would only delay it behind the less urgent prompts
        computing there as the slot frees. One such request at a time per band: the next waits until it has its
        first token. The request's own priority counts, not the one it aged to in the queue (aging orders the
        queue; it does not open the gate)."""
        if not self._gate_free(tenant):
            return False
        less_urgent = False
        for grant in self.grants:
            if grant.priority <= priority and not grant.prefilled():
                return False
            less_urgent = less_urgent or grant.priority > priority
        return less_urgent

    def _gate_free(self, tenant: str) -> bool:
        """Nothing let on is unplaced, below max_in_flight, and the tenant below its own cap."""
        limit = self.config.max_in_flight
        return not self.placing and (limit is None or self.in_flight < limit) and self._tenant_has_room(tenant)

    def _room(self) -> bool:
        """Room for one more: below max_in_flight, and the router not saturated as far as it can tell, that
        is with every request let through already placed (so the queue lets requests on one at a time
        while the cluster is near its saturation, not in a burst the loads show only afterwards)."""
        limit = self.config.max_in_flight
        return (limit is None or self.in_flight < limit) and not self.placing and not self.saturated()

    def _tenant_has_room(self, tenant: str) -> bool:
        cap = self.config.policy(tenant).max_concurrent
        running = self.running.get(tenant, 0)
        if cap is None:
            return True
        return running < cap and (self.shared is None or self.shared.has_slot(tenant, running))

    def _has_room(self, tenant: str) -> bool:
        return self._room() and self._tenant_has_room(tenant)

    def _start(self, tenant: str, priority: int, waited_s: float, ahead: bool = False) -> None:
        self.in_flight += 1
        self.placing += 1
        self.last_start = self.clock()
        self.running[tenant] = self.running.get(tenant, 0) + 1
        if self.metrics is not None:
            self.metrics.admitted.labels(tenant, str(priority)).inc()
            if ahead:
                self.metrics.ahead.labels(tenant).inc()
            self.metrics.queue_time.labels(tenant).observe(waited_s)
            self.metrics.running.labels(tenant).set(self.running[tenant])

    def _finish(self, tenant: str) -> None:
        self.in_flight -= 1
        self.running[tenant] -= 1
        if self.metrics is not None:
            self.metrics.running.labels(tenant).set(self.running[tenant])

    def _placed(self, pump: bool = True) -> None:
        self.placing -= 1
        if pump:
            self.pump()

    def _leave(self, grant: Grant, unused: int | None) -> None:
        self.grants.discard(grant)
        self._finish(grant.tenant)
        if unused is not None:
            self._refund(grant, unused)
        self.pump()
        self._trim_slots(grant.tenant)

    def _refund(self, grant: Grant, tokens: int) -> None:
        """Give `tokens` of the request's charge back to its tenant's budget."""
        if grant.charged and tokens > 0:
            if self.shared is not None:
                per_minute = self.config.policy(grant.tenant).tokens_per_minute
                if per_minute is not None:
                    self.shared.give_back(grant.tenant, per_minute, min(tokens, grant.charged))
            elif (bucket := self.buckets.get(grant.tenant)) is not None:
                bucket.give_back(min(tokens, grant.charged))
        grant.charged = 0

    def _watch(self) -> None:
        """While requests queue, wake on every load change (`wait_for_loads`): the router's saturation may
        have cleared without a request of this ingress ending."""
        if self.wait_for_loads is None or (self._watcher is not None and not self._watcher.done()):
            return

        async def watch() -> None:
            said = self.clock()
            while len(self.queue):
                await self.wait_for_loads(WATCH_POLL_S)
                try:
                    self.pump()
                except Exception:  # a bug: say so, count it, and keep watching rather than strand the queue
                    logger.exception("the ingress queue's watcher failed to let requests on")
                    if self.metrics is not None:
                        self.metrics.pump_errors.inc()
                if self.clock() - max(said, self.last_start) > STUCK_WARN_S and len(self.queue):
                    said = self.clock()
                    head = self.queue.peek(said, self._tenant_has_room)
                    logger.warning("the ingress queue has let nothing on for %.0fs: %d queued, %d placed, %d not "
                                   "placed yet, router saturated: %s, next ready: %s", said - self.last_start,
                                   len(self.queue), self.in_flight, self.placing, self.saturated(),
                                   None if head is None or head.ready is None else head.ready())

        self._watcher = asyncio.get_running_loop().create_task(watch())

    def _refused(self, tenant: str, priority: int, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.refused.labels(tenant, str(priority), reason).inc()

    def _observe_queue(self) -> None:
        if self.metrics is None:
            return
        for tenant in set(self.running) | set(self.queue.tenants):
            self.metrics.queued.labels(tenant).set(self.queue.queued(tenant))
