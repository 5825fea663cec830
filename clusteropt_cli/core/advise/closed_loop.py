"""Closed-loop clients run through the engine step by step: what load testers measure.

A closed loop is what `copt profile endpoint --concurrency N`, guidellm's concurrent profile and `vllm bench serve
--max-concurrency` send: N clients, each sending its next request when its previous one ends. The round model of
timing.infer_time prices every client's request arriving at once (a burst, or clients still in step). After the first
round the clients drift out of step — each finishes when its own prefill and decode did — so steps mix some prompts'
prefill with everyone's decode, and a request waits only for the prefill queued ahead of it. Its time to first token
then depends on how the arrivals spread, which no closed form gives; this module replays the
load through copt's scheduler (core/serve/engine.py Engine._step: decode every running sequence, then prefill
prompt chunks first come, first served with what is left of the step's token budget; the decode's tokens and the
results of the requests it finished go out before the prefill runs) with infer_time's own step costs
(timing.ServeCosts), and measures the replay as the clients would.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from functools import lru_cache

from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.core.advise.timing import ServeCosts, infer_time
from clusteropt_cli.modelspec import ModelSpec


@dataclass
class ClosedLoopFigures:
    """The replayed load measured as a client measures it (medians over every request; seconds)."""

    clients: int
    requests: int
    duration_s: float  # first request sent → last token received
    output_tokens_per_s: float
    ttft_s: float
    tpot_s: float
    ttft_first_round_s: float  # the requests each client sent first (the burst the loop starts with)
    ttft_later_rounds_s: float | None  # every later request (None: one request per client)
    host_bound_share: float = 0.0  # of the steps that prefilled, the host-bound ones (ServeCosts.step_with_prefill)
    queued_share: float = 0.0  # of the median TTFT, the median wait before a request's first prompt chunk ran
    steps: int = 0
    truncated: bool = False  # stopped at max_steps with requests still to run: the figures cover those done
    per_request: list[tuple[float, float, float]] = field(default_factory=list, repr=False)  # (sent, first, last)

    @property
    def ttft_amplification(self) -> float:
        """How many percent the median TTFT moves per percent of decode time: the median request's decode (first
        token → last) over its TTFT. Each closed-loop client's cycle is its TTFT, its decode and its turnaround; where
        the engine is full (most of the TTFT queued: queued_share) its throughput sets the cycle, so the TTFT is what
        the decode leaves of it, and an error of x% in the decode's share of the cycle (how many sequences decode at
        once) is one of about this many times x% in the TTFT."""
        if not self.per_request or not self.ttft_s > 0:
            return float("nan")
        return _median([last - first for _, first, last in self.per_request]) / self.ttft_s


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


class _Request:
    __slots__ = ("client", "round", "sent", "left", "first", "started")

    def __init__(self, client: int, round_: int, sent: float, prompt_tokens: int):
        self.client, self.round, self.sent = client, round_, sent
        self.left, self.first = max(1, prompt_tokens), 0.0
        self.started: float | None = None  # when its first prompt chunk ran


# the engine steps a replay runs at most: a load that needs more is reported truncated (no figures)
MAX_REPLAY_STEPS = 200_000


def replay_applies(spec: ModelSpec, plan: InferPlan, target: Target) -> bool:
    """Whether the step model's replay applies to the plan: copt's engine under continuous batching, no speculative
    decoding, a GPU (a plan it applies to that gets no figures was too long to replay)."""
    if target.gpu is None:
        return False
    return infer_time(spec, replace(plan, batch=max(plan.batch, 2)), target).costs is not None


def fewest_steps(costs: ServeCosts, gen_len: int, requests: float) -> float:
    """The fewest engine steps `requests` requests can take: a step decodes at most costs.max_running rows (one token
    each) and prefills at most costs.step_tokens prompt tokens."""
    return requests * max((gen_len - 1) / max(1, costs.max_running), costs.prompt_tokens / max(1, costs.step_tokens))


def _out_of_steps(clients: int, duration_s: float = 0.0, steps: int = 0) -> ClosedLoopFigures:
    """The figures of a load that finished no request within the replay's steps: none (truncated). With no steps
    run, found without replaying it (a mistyped --batch or --rate must not hold advise for minutes or fill the
    host's memory)."""
    nan = float("nan")
    return ClosedLoopFigures(clients=clients, requests=0, duration_s=duration_s, output_tokens_per_s=0.0, ttft_s=nan,
                             tpot_s=nan, ttft_first_round_s=nan, ttft_later_rounds_s=None, steps=steps,
                             truncated=True)


def simulate_closed_loop(costs: ServeCosts, clients: int, gen_len: int, *, requests: int | None = None,
                         duration_s: float | None = None, max_steps: int = MAX_REPLAY_STEPS,
                         turnaround_s: float = 0.0) -> ClosedLoopFigures:
    """N closed-loop clients through the engine: each sends its first request at time 0 and its next one as soon as
    the last token of the previous one arrived (`turnaround_s` later: the client's own time between an answer and
    its next request, and the HTTP transport's), while fewer than `requests` were sent in all (copt profile
    endpoint's --num-requests, 4 per client by default; guidellm's max_requests) and it is before `duration_s` (then
    the requests in flight finish, as `copt profile endpoint --duration` does). Requests queue for the API process
    (costs.intake_s each), then for the engine."""
    if turnaround_s < 0:
        raise ValueError("turnaround_s must not be negative")
    if clients < 1 or gen_len < 1:
        raise ValueError("clients and gen_len must be at least 1")
    if duration_s is None and requests is None:
        raise ValueError("a closed loop needs a request count or a duration")
    if fewest_steps(costs, gen_len, clients if requests is None else min(clients, requests)) > max_steps:
        return _out_of_steps(clients)  # every client's first request is sent at once and runs to its end
    return _replay(costs, gen_len, [(0.0, client) for client in range(clients)], closed=True, requests=requests,
                   duration_s=duration_s, max_steps=max_steps, turnaround_s=turnaround_s)


def simulate_open_loop(costs: ServeCosts, rate: float, gen_len: int, *, requests: int | None = None,
                       duration_s: float | None = None, seed: int = 0, arrivals: str = "poisson",
                       max_steps: int = MAX_REPLAY_STEPS) -> ClosedLoopFigures:
    """Requests sent at `rate` whatever the answers do — at Poisson times (`copt profile endpoint --rate`: the same
    times, from its poisson_send_times; guidellm's poisson profile and `vllm bench serve --request-rate` send the
    same way) or, `arrivals="constant"`, evenly (guidellm's constant profile) — through the same API queue and
    engine steps as simulate_closed_loop; `clients` of the figures is the number of requests."""
    from clusteropt_cli.core.profile.endpoint import poisson_send_times

    if gen_len < 1:
        raise ValueError("gen_len must be at least 1")
    if duration_s is None and requests is None:
        raise ValueError("an open loop needs a request count or a duration")
    if rate > 0 and duration_s is not None and duration_s > 0:
        # the sends before the end (a Poisson count well above half its mean), at most `requests`: too many to finish
        sends = min(rate * duration_s / 2, math.inf if requests is None else requests)
        if fewest_steps(costs, gen_len, sends) > max_steps:
            return _out_of_steps(int(min(sends, 2**31)))
    if arrivals == "constant":
        if rate <= 0:
            raise ValueError("the rate must be positive")
        bounds = [n for n in (requests, None if duration_s is None else math.ceil(duration_s * rate)) if n is not None]
        sends = [i / rate for i in range(min(bounds))]  # every send before duration_s, at most `requests`
    elif arrivals == "poisson":
        sends = list(poisson_send_times(rate, duration_s=duration_s, requests=requests, seed=seed))
    else:
        raise ValueError(f"arrivals must be poisson or constant (got {arrivals!r})")
    return simulate_sends(costs, gen_len, sends, max_steps=max_steps)


def simulate_sends(costs: ServeCosts, gen_len: int, send_times: list[float], *,
                   max_steps: int = MAX_REPLAY_STEPS, step_log: list | None = None) -> ClosedLoopFigures:
    """Requests sent at the given times (seconds from the load's start) whatever the answers do, through the API
    queue and engine steps: the open loop of simulate_open_loop, or a measured load's own arrivals (an engine
    trace's, bench/engine_trace_report.py --replay-arrivals). `step_log`: a list that receives one (seconds,
    decoding rows, prompt chunks) per replayed step."""
    if gen_len < 1:
        raise ValueError("gen_len must be at least 1")
    if fewest_steps(costs, gen_len, len(send_times)) > max_steps:
        return _out_of_steps(len(send_times))
    return _replay(costs, gen_len, [(at, i) for i, at in enumerate(sorted(send_times))], closed=False,
                   requests=None, duration_s=None, max_steps=max_steps, step_log=step_log)


def _replay(costs: ServeCosts, gen_len: int, planned_sends: list[tuple[float, int]], *, closed: bool,
            requests: int | None, duration_s: float | None, max_steps: int,
            step_log: list | None = None, turnaround_s: float = 0.0) -> ClosedLoopFigures:
    """Step the engine through the planned sends (time, client), in time order; closed: a client sends again when
    its request's last token arrived (`turnaround_s` later: such a send waits its turn among the planned ones, so the
    API process takes requests in the order they were sent). `step_log` receives (seconds, decoding rows, prompt
    chunks) per step."""
    clients = len(planned_sends)
    planned = sorted(planned_sends)  # a heap: closed loops' later sends join it
    decode_s = lru_cache(maxsize=None)(costs.decode_step)
    mixed_s = lru_cache(maxsize=None)(costs.step_with_prefill)
    chain_start_s = lru_cache(maxsize=None)(costs.chain_start)
    unchained_s = lru_cache(maxsize=None)(costs.unchained_s)
    api_free = 0.0  # when the API process is next idle
    arrivals: list[tuple[float, int, _Request]] = []  # (reaches the engine, order, request)
    order = 0
    sent_by = [0] * clients

    def send(client: int, at: float) -> None:
        nonlocal api_free, order
        if (duration_s is not None and at >= duration_s) or (requests is not None and order >= requests):
            return
        request = _Request(client, sent_by[client], at, costs.prompt_tokens)
        sent_by[client] += 1
        api_free = max(at, api_free) + costs.intake_s
        heapq.heappush(arrivals, (api_free, order, request))
        order += 1

    waiting: deque[_Request] = deque()  # arrived, not yet admitted (no free place)
    prefilling: deque[_Request] = deque()  # admitted, prompt not fully computed: first come, first served
    finishing: dict[int, list[_Request]] = defaultdict(list)  # step index → the requests whose last token it makes
    decoding = 0  # requests generating (every one decodes in every step)
    done: list[tuple[_Request, float]] = []
    now, steps, prefill_steps, host_bound = 0.0, 0, 0, 0
    chained = False  # the previous step decoded and prefilled nothing: this one goes on its chain
    while steps < max_steps:
        while planned and planned[0][0] <= now:  # sent before the step starts (the API queue decides when it arrives)
            at, client = heapq.heappop(planned)
            send(client, at)
        while arrivals and arrivals[0][0] <= now:
            waiting.append(heapq.heappop(arrivals)[2])
        while waiting and len(prefilling) + decoding < costs.max_running:
            prefilling.append(waiting.popleft())
        if not prefilling and not decoding:
            if not arrivals and not planned:
                break
            now = min(arrivals[0][0] if arrivals else float("inf"), planned[0][0] if planned else float("inf"))
            continue
        budget = max(costs.step_tokens - decoding, 16)
        chunks: list[tuple[_Request, int]] = []
        for r in prefilling:
            if budget <= 0:
                break
            n = min(r.left, budget)
            chunks.append((r, n))
            budget -= n
            if r.started is None:
                r.started = now
        step = decode_s(decoding) if decoding else 0.0
        if decoding and (chunks or waiting):  # not chained (Engine._can_chain): its tokens read and emitted first
            step += unchained_s(decoding)
        elif decoding and not chained:  # a decode chain starts: its first pass overlaps nothing
            step += chain_start_s(decoding)
        decoded = now + step  # the decode's tokens (and finished requests' results) go out before the prefill
        if chunks:
            cached = sum(costs.prompt_tokens - r.left for r, _ in chunks)  # resumed prompts' tokens computed earlier
            step, floored = mixed_s(decoding, sum(n for _, n in chunks), len(chunks), cached)
            prefill_steps += 1
            host_bound += floored
        now += step
        if step_log is not None:
            step_log.append((step, decoding, len(chunks)))
        finished = finishing.pop(steps, [])
        emitted = decoded if costs.results_before_prefill else now
        if decoding:  # the API process streams the decode's tokens, one event per sequence, after what it had to do
            api_free = max(emitted, api_free) + decoding * costs.stream_token_s
        # copt's engine ends a decode chain when a request arrives (then prefills) or one of its sequences finishes
        chained = bool(decoding) and not chunks and not finished
        decoding -= len(finished)
        answered = [(r, api_free) for r in finished]  # their last tokens have gone out: the clients have the answers
        for r, n in chunks:
            r.left -= n
            if r.left == 0:  # its first token comes with this step
                prefilling.popleft()
                r.first = now
                if gen_len == 1:  # its one token is its answer: it goes out through the API after the prefill
                    api_free = max(now, api_free) + costs.stream_token_s
                    answered.append((r, api_free))
                else:
                    finishing[steps + gen_len - 1].append(r)
                    decoding += 1
        steps += 1
        for r, at in answered:
            done.append((r, at))
            if closed and turnaround_s > 0:  # sent later: it queues for the API process when it is made
                heapq.heappush(planned, (at + turnaround_s, r.client))
            elif closed:  # sent as the answer went out (`at`, when the API process is free): in order as it is
                send(r.client, at)
    truncated = bool(planned or arrivals or waiting or prefilling or decoding)
    if not done:  # max_steps ran out before the first request ended
        return _out_of_steps(clients, now, steps)
    ttft = [r.first + costs.first_token_s - r.sent for r, _ in done]
    first_round = [t for (r, _), t in zip(done, ttft, strict=True) if r.round == 0]
    later = [t for (r, _), t in zip(done, ttft, strict=True) if r.round > 0]
    tpot = [(last - r.first) / (gen_len - 1) for r, last in done] if gen_len > 1 else [0.0]
    end = max(last for _, last in done)
    ttft_p50 = _median(ttft)
    return ClosedLoopFigures(
        clients=clients, requests=len(done), duration_s=end,
        output_tokens_per_s=len(done) * gen_len / end if end > 0 else 0.0,
        ttft_s=ttft_p50, tpot_s=max(0.0, _median(tpot)),
        ttft_first_round_s=_median(first_round), ttft_later_rounds_s=_median(later) if later else None,
        host_bound_share=host_bound / prefill_steps if prefill_steps else 0.0,
        queued_share=min(1.0, _median([r.started - r.sent for r, _ in done]) / ttft_p50) if ttft_p50 > 0 else 0.0,
        steps=steps, truncated=truncated,
        per_request=[(r.sent, r.first + costs.first_token_s, last) for r, last in done])


def implied_ttft_ratio(cycle_ttfts: float, decode_ttfts: float, tok_s_ratio: float, tpot_ratio: float) -> float:
    """The TTFT ratio (predicted ÷ measured) a closed loop's tok/s and TPOT ratios alone imply. Each client's cycle
    (clients × output tokens ÷ tok/s) is its TTFT, its decode and its turnaround, so the TTFT is the cycle less the
    rest: with the measured cycle and decode in TTFTs, exp(-cycle × ln tok/s ratio - decode × ln TPOT ratio)."""
    return math.exp(-cycle_ttfts * math.log(tok_s_ratio) - decode_ttfts * math.log(tpot_ratio))


def ttft_explained(ttft_ratio: float, implied_ratio: float, decode_ttfts: float, tok_s_and_tpot_passed: bool,
                   tolerance: float) -> bool:
    """Whether a closed loop's TTFT (predicted ÷ measured `ttft_ratio`) missed by what its tok/s and TPOT errors
    imply (`implied_ratio`, implied_ttft_ratio): they passed, the decode is AMPLIFIED_TTFT times the TTFT or more, and
    the TTFT's ratio is within `tolerance` of the implied one. `copt profile endpoint --expect` marks such a TTFT
    explained rather than missed."""
    return (tok_s_and_tpot_passed and decode_ttfts >= AMPLIFIED_TTFT
            and abs(ttft_ratio / implied_ratio - 1) <= tolerance)


# copt profile endpoint's default load per concurrency level: 4 requests per client (ProfileSettings.requests_for)
REQUESTS_PER_CLIENT = 4
# the share of host-bound prefilling steps above which the replay's TTFT is not reported (closed_loop_figures)
HOST_BOUND_TTFT_LIMIT = 0.5
# the share of the TTFT spent queued from which a closed loop's engine counts as full: its throughput sets the
# clients' cycle, and the TTFT amplifies errors in the decode (ClosedLoopFigures.ttft_amplification)
QUEUED_TTFT_SHARE = 0.5
# the amplification from which advise's notes and `copt profile endpoint --expect`'s caveats call a TTFT a band
AMPLIFIED_TTFT = 3.0


def closed_loop_figures(spec: ModelSpec, plan: InferPlan, target: Target, *, requests: int | None = None,
                        duration_s: float | None = None, results_before_prefill: bool = True,
                        masked_prefill_graphs: bool = False,
                        turnaround_s: float = 0.0) -> tuple[dict[str, float], dict[str, float]] | None:
    """The plan's `batch` clients as a closed loop through copt's engine: (figures, workload). Figures are named
    closed_loop_ttft_s, closed_loop_tpot_s (medians over the requests) and closed_loop_output_tokens_per_s, with
    closed_loop_ttft_amplification next to the TTFT where the engine was full (ClosedLoopFigures.ttft_amplification,
    QUEUED_TTFT_SHARE); the workload is `requests` in all (default: REQUESTS_PER_CLIENT per client, as `copt profile
    endpoint` sends) or `duration_s`. None where the step model does not apply (one client, a static batch, another
    engine, speculative decoding, no GPU) or the load is too long to replay (over 200,000 steps). The TTFT is left out
    when most prefilling steps are host-bound (a small model): there the measured loops stay in step — prefill
    bursts, then long decode stretches — which the replay does not reproduce (H200, 1B shape at 128-256 clients:
    replayed 0.05-0.13 s against 0.15-0.63 measured). `results_before_prefill` False replays an engine that hands a
    step's decoded tokens out only after the step's prefill (copt's before it handed them out early);
    `masked_prefill_graphs` True one whose prefill graphs took new prompts only (ServeCosts.masked_prefill_graphs);
    `turnaround_s` is each client's time between an answer and its next request (simulate_closed_loop)."""
    if plan.batch < 2 or target.gpu is None:
        return None
    costs = infer_time(spec, plan, target).costs
    if costs is None:
        return None
    costs = replace(costs, results_before_prefill=results_before_prefill, masked_prefill_graphs=masked_prefill_graphs)
    if requests is None and duration_s is None:
        requests = REQUESTS_PER_CLIENT * plan.batch
    run = simulate_closed_loop(costs, plan.batch, plan.gen_len, requests=requests, duration_s=duration_s,
                               turnaround_s=turnaround_s)
    if run.truncated:
        return None
    figures = {"closed_loop_tpot_s": run.tpot_s, "closed_loop_output_tokens_per_s": run.output_tokens_per_s}
    if run.host_bound_share <= HOST_BOUND_TTFT_LIMIT:
        figures["closed_loop_ttft_s"] = run.ttft_s
        if run.queued_share >= QUEUED_TTFT_SHARE:
            figures["closed_loop_ttft_amplification"] = run.ttft_amplification
    workload = {"closed_loop_requests": requests} if requests is not None else {"closed_loop_duration_s": duration_s}
    return figures, workload


def open_loop_figures(spec: ModelSpec, plan: InferPlan, target: Target, *, rate: float,
                      duration_s: float | None = None, requests: int | None = None, seed: int = 0,
                      arrivals: str = "poisson", masked_prefill_graphs: bool = False) -> dict[str, float] | None:
    """Requests at `rate` per second (Poisson, as `copt profile endpoint --rate` sends them with its --seed, or
    evenly spaced: `arrivals`, simulate_open_loop) through
    copt's engine: open_loop_ttft_s, open_loop_tpot_s (medians) and open_loop_output_tokens_per_s (first send to
    last token). None where closed_loop_figures gives none (the plan's step model does not apply, or the replay
    ran out of steps: the rate is past what the engine serves for longer than the load lasts); the TTFT is left
    out where most prefilling steps are host-bound, and `masked_prefill_graphs` replays the earlier engine, as
    there."""
    from clusteropt_cli.core.advise.memory import max_concurrent_seqs

    if target.gpu is None:
        return None
    engine_rows = max_concurrent_seqs(spec, replace(plan, continuous_batching=True), target) or 2
    costs = infer_time(spec, replace(plan, batch=max(engine_rows, 2)), target).costs  # as many as the engine runs
    if costs is None:
        return None
    costs = replace(costs, masked_prefill_graphs=masked_prefill_graphs)
    run = simulate_open_loop(costs, rate, plan.gen_len, requests=requests, duration_s=duration_s, seed=seed,
                             arrivals=arrivals)
    if run.truncated or not run.requests:
        return None
    figures = {"open_loop_tpot_s": run.tpot_s, "open_loop_output_tokens_per_s": run.output_tokens_per_s}
    if run.host_bound_share <= HOST_BOUND_TTFT_LIMIT:
        figures["open_loop_ttft_s"] = run.ttft_s
    return figures
