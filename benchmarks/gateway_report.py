"""What ``gateway_bench`` measured, as tables and as issues 25's, 31's and 47's targets beside the figures of the
run."""

from __future__ import annotations

from benchmarks.gateway_workload import (FLEET_INSTANCES, FLEET_LEVELS, LEVELS, PROCESSES, TURN_CONVERSATIONS,
                                         TURN_SWEEPS, TURNS)
from benchmarks.targets import Target
from trajbus.pipelines.tables import print_table


def gateway_cpu(row: dict) -> float:
    """The gateway's CPU ms per call of a level's calls through it."""
    return row["cpu"]["gateway"]["cpu_ms_per_call"]["gateway"]


def _phases(row: dict) -> str:
    """Every phase's CPU per call at a level, in the order run (the row is the median one)."""
    return " ".join(f"{ms:.2f}" for ms in row.get("phases_ms", [])) + " ms"


def stream_price(cost: dict) -> tuple:
    """Issue 31's bound on cut-and-continue's price at one level of ``compare_streaming``."""
    streamed, unstreamed = cost["median_ms"]["always"], cost["median_ms"]["when-asked"]
    return (f"cut-and-continue / when-asked, gateway CPU at {cost['agents']} agent(s) (medians)", "<= 1.2x",
            f"{streamed / unstreamed:.3f}x ({streamed:.2f} vs {unstreamed:.2f} ms)", streamed <= 1.2 * unstreamed)


FLOOR_BOUNDS = {1: 2.0, 32: 1.5, 256: 1.5}
"""Issue 47: the gateway's CPU per call at most this many times the libraries' floor's, per level."""
TURN_GROWTH_BOUND = 1.15
"""Issue 47: CPU per call at turn 10 at most this many times turn 1's, at 1 agent."""


def floor_checks(levels: dict[int, dict], floors: dict[int, dict]) -> list[tuple]:
    """Issue 47's bounds against the libraries' floor, measured in the same run."""
    checks = []
    for agents, bound in FLOOR_BOUNDS.items():
        gateway, floor = gateway_cpu(levels[agents]), gateway_cpu(floors[agents])
        checks.append((f"gateway / floor CPU per call at {agents} agent(s)", f"<= {bound}x",
                       f"{gateway / floor:.2f}x ({gateway:.2f} vs {floor:.2f} ms)", gateway <= bound * floor))
    return checks


def targets(result: dict) -> list[Target]:
    """Issues 25's, 31's and 47's targets, each with the measured figure and whether it is met (compared
    unrounded)."""
    levels = {row["agents"]: row for row in result["levels"]}
    turn_1 = gateway_cpu(next(t for t in result["per_turn"] if t["turn"] == 1))
    turn_10 = gateway_cpu(next(t for t in result["per_turn"] if t["turn"] == TURNS))
    produce, added = result["produce"]["p50_ms"], levels[1]["added_p50_ms"]
    rps_32, rps_256 = levels[32]["gateway_rps"], levels[256]["gateway_rps"]
    fleet = {row["agents"]: row for row in result["fleet"]}
    floors = {row["agents"]: row for row in result["library_floor"]}
    fleet_checks = [(f"{FLEET_INSTANCES} instances / 1 at {agents} agents", "> 1.0x",
                     f"{fleet[agents]['gateway_rps'] / levels[agents]['gateway_rps']:.3f}x "
                     f"({fleet[agents]['gateway_rps']:.1f} vs {levels[agents]['gateway_rps']:.1f} req/s)",
                     fleet[agents]["gateway_rps"] > levels[agents]["gateway_rps"]) for agents in FLEET_LEVELS]
    checks = [
        ("gateway CPU per call at turn 10, 1 agent", "<= 2 ms", f"{turn_10:.2f} ms", turn_10 <= 2.0),
        (f"gateway CPU per call at turn {TURNS} / turn 1, 1 agent", f"<= {TURN_GROWTH_BOUND}x",
         f"{turn_10 / turn_1:.2f}x ({turn_10:.2f} vs {turn_1:.2f} ms, medians of {TURN_SWEEPS} sweeps)",
         turn_10 <= TURN_GROWTH_BOUND * turn_1),
        *floor_checks(levels, floors),
        *((f"gateway CPU per call at {agents} agents (turns 1-10)", "<= 2 ms",
           f"{gateway_cpu(levels[agents]):.2f} ms (the libraries' floor: {gateway_cpu(floors[agents]):.2f} ms)",
           gateway_cpu(levels[agents]) <= 2.0) for agents in LEVELS),
        *(stream_price(cost) for cost in result["stream_cost"]),
        ("added p50 at 1 agent", f"<= produce p50 + 2 ms = {produce + 2:.2f} ms",
         f"{added:.2f} ms (the libraries' floor: {floors[1]['added_p50_ms']:.2f} ms)", added <= produce + 2.0),
        *((f"throughput at {agents} agents / direct", ">= 0.8x",
           f"{levels[agents]['throughput_ratio']:.3f}x "
           f"(the libraries' floor: {floors[agents]['throughput_ratio']:.3f}x)",
           levels[agents]["throughput_ratio"] >= 0.8) for agents in (32, 256)),
        ("throughput at 256 agents / at 32", ">= 1.0x",
         f"{rps_256 / rps_32:.3f}x ({rps_256:.1f} vs {rps_32:.1f} req/s; "
         f"the engine called directly: {levels[256]['direct_rps'] / levels[32]['direct_rps']:.3f}x)",
         rps_256 >= rps_32),
        *fleet_checks,
    ]
    return [Target(*check) for check in checks]


def _ms(figures: dict[str, float], name: str) -> str:
    return f"{figures[name]:.2f} ms" if name in figures else "-"


def cpu_cells(summary: dict, rate: bool = False) -> list[str]:
    """(The phase's calls per second,) CPU ms per call of each process, their sum, and the cores they and
    the whole machine kept busy."""
    ms, cores = summary["cpu_ms_per_call"], summary["cores"]
    return [*([f"{summary['calls'] / summary['wall_s']:.1f}"] if rate else []),
            *(_ms(ms, name) for name in PROCESSES), f"{sum(ms.values()):.2f} ms",
            f"{sum(v for k, v in cores.items() if k != 'machine'):.2f}", f"{cores['machine']:.2f}"]


def print_tables(result: dict) -> None:
    print_table(["agents", "requests", "direct p50", "direct p99", "direct req/s", "gateway p50", "gateway p99",
                 "gateway req/s", "added p50", "added p99", "ratio"],
                [[r["agents"], r["requests"], f"{r['direct_p50_ms']:.2f} ms", f"{r['direct_p99_ms']:.0f} ms",
                  f"{r['direct_rps']:.1f}", f"{r['gateway_p50_ms']:.2f} ms", f"{r['gateway_p99_ms']:.0f} ms",
                  f"{r['gateway_rps']:.1f}", f"{r['added_p50_ms']:.2f} ms", f"{r['added_p99_ms']:.0f} ms",
                  f"{r['throughput_ratio']:.2f}x"] for r in result["levels"]])
    print()
    print_table(["agents", "instances", "gateway req/s", "gateway p50", "gateway p99", "gateway CPU/call",
                 "cores (machine)", "1 instance req/s"],
                [[r["agents"], FLEET_INSTANCES, f"{r['gateway_rps']:.1f}", f"{r['gateway_p50_ms']:.2f} ms",
                  f"{r['gateway_p99_ms']:.0f} ms", _ms(r["cpu"]["gateway"]["cpu_ms_per_call"], "gateway"),
                  f"{r['cpu']['gateway']['cores']['machine']:.2f}",
                  f"{next(x for x in result['levels'] if x['agents'] == r['agents'])['gateway_rps']:.1f}"]
                 for r in result["fleet"]],
                title=f"{FLEET_INSTANCES} gateway instances (trajbus gateway --instances {FLEET_INSTANCES}), "
                      "trajectories opened at each in turn")
    print()
    print_table(["agents", "gateway CPU/call", "floor CPU/call", "gateway / floor", "gateway req/s", "floor req/s",
                 "gateway phases", "floor phases"],
                [[r["agents"], f"{gateway_cpu(r):.2f} ms", f"{gateway_cpu(f):.2f} ms",
                  f"{gateway_cpu(r) / gateway_cpu(f):.2f}x", f"{r['gateway_rps']:.1f}", f"{f['gateway_rps']:.1f}",
                  _phases(r), _phases(f)]
                 for r, f in zip(result["levels"], result["library_floor"])],
                title="The libraries' floor (benchmarks.library_floor: the same calls through uvicorn, the new "
                      "message tokenized, an aiohttp engine stream and one acknowledged produce, no trajbus code); "
                      "each level's median phase of its alternating ones")
    print()
    cpu_columns = [f"{name} CPU/call" for name in PROCESSES] + ["sum CPU/call", "cores (these)", "cores (machine)"]
    print_table(["agents", "path", "calls", "req/s", *cpu_columns],
                [[r["agents"], path, r["cpu"][path]["calls"], *cpu_cells(r["cpu"][path], rate=True)]
                 for r in result["levels"] for path in ("direct", "gateway")],
                title="CPU per call by process (user + system, the kernel's accounting), per concurrency")
    print()
    print_table(["turn", "prompt tokens", "direct p50", "gateway p50", "added p50", "added p50, --multi-turn render",
                 *(f"{name} CPU/call" for name in PROCESSES), "direct: engine CPU/call", "direct: client CPU/call"],
                [[t["turn"], t["prompt_tokens"], f"{t['direct_p50_ms']:.2f} ms", f"{t['gateway_p50_ms']:.2f} ms",
                  f"{t['added_p50_ms']:.2f} ms", f"{t['render_added_p50_ms']:.2f} ms",
                  *(_ms(t["cpu"]["gateway"]["cpu_ms_per_call"], name) for name in PROCESSES),
                  _ms(t["cpu"]["direct"]["cpu_ms_per_call"], "engine"),
                  _ms(t["cpu"]["direct"]["cpu_ms_per_call"], "client")] for t in result["per_turn"]],
                title=f"1 agent, by turn number (CPU: {TURN_CONVERSATIONS} calls per turn, one at a time, the median "
                      f"of {TURN_SWEEPS} sweeps over new conversations)")
    produce, one = result["produce"], result["levels"][0]
    print(f"\nacknowledged produce of one {produce['tokens']}-token step, one at a time: "
          f"p50 {produce['p50_ms']:.2f} ms, p99 {produce['p99_ms']:.2f} ms; "
          f"the gateway's added p50 at 1 agent: {one['added_p50_ms']:.2f} ms")
    for cost in result["stream_cost"]:
        phases = cost["phases_ms"]
        print(f"gateway CPU per call at {cost['agents']} agent(s), phases alternating: streamed (cut-and-continue) "
              f"{' '.join(f'{v:.2f}' for v in phases['always'])} ms, --engine-streaming when-asked "
              f"{' '.join(f'{v:.2f}' for v in phases['when-asked'])} ms")
