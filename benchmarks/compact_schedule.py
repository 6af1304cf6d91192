"""Simulated step times of 1F1B, ZB-H1 and the compact zero-bubble schedule on uneven pipelines.

Prints a Markdown table: for each example pipeline (uneven stages and/or links) and two memory
settings (1F1B's default in-flight caps ``p - s``, and ``m`` micro-batches per stage), the
simulated step time of plain 1F1B, split 1F1B (B then W), ZB-H1 and ``compact_zero_bubble``, and
the compact schedule's peak micro-batches in flight per stage. Pure Python; the schedules
take about a second (importing the package, which pulls in Lightning, takes longer).

Run from the repository root::

    python benchmarks/compact_schedule.py
"""

from __future__ import annotations

from lightning_deepcee.schedule.compact import (
    compact_zero_bubble,
    default_max_in_flight,
    in_flight_peak,
    simulated_step_time,
    split_backward,
)
from lightning_deepcee.schedule.generators import one_f_one_b, zb_h1
from lightning_deepcee.schedule.simulate import StageCosts

__all__ = ["EXAMPLES", "main"]

NUM_MICROBATCHES = 8


def _costs(
    f: list[float], b: list[float], w: list[float], send_f: list[float], send_b: list[float]
) -> StageCosts:
    return StageCosts(
        forward_s=tuple(f),
        backward_input_s=tuple(b),
        backward_weight_s=tuple(w),
        activation_bytes=(0.0,) * len(f),
        send_forward_s=tuple(send_f),
        send_backward_s=tuple(send_b),
    )


EXAMPLES: dict[str, StageCosts] = {
    "4 equal stages, WAN hop 1-2 (3 s), LAN 0.1 s": _costs(
        [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.1, 3.0, 0.1], [0.1, 3.0, 0.1]
    ),
    "4 stages, stage 1 2x slower, links 1 s": _costs(
        [1, 2, 1, 1], [1, 2, 1, 1], [1, 2, 1, 1], [1.0] * 3, [1.0] * 3
    ),
    "cloud-edge-end: 0.5/1/2 s per pass, links 0.5 s and 4 s": _costs(
        [0.5, 1.0, 2.0], [0.5, 1.0, 2.0], [0.5, 1.0, 1.0], [0.5, 4.0], [0.5, 4.0]
    ),
}


def main() -> None:
    """Print the table."""
    m = NUM_MICROBATCHES
    print(f"m = {m} micro-batches; times in seconds (simulate(), one stage per rank)\n")
    print("| pipeline | in-flight caps | 1f1b | 1f1b split | zb-h1 | compact | compact in flight |")
    print("|---|---|---|---|---|---|---|")
    for name, costs in EXAMPLES.items():
        p = costs.num_stages
        zb = zb_h1(p, m)
        zb_peak = in_flight_peak(zb)
        for label, caps in (("p - s", default_max_in_flight(p, m)), ("m", [m] * p)):
            compact = compact_zero_bubble(costs, m, max_in_flight=caps)
            zb_fits = all(zb_peak[s] <= caps[s] for s in range(p))
            zb_text = f"{simulated_step_time(zb, costs, m):.1f}" + ("" if zb_fits else "*")
            peaks = in_flight_peak(compact)
            print(
                f"| {name} | {label} | {simulated_step_time(one_f_one_b(p, m), costs, m):.1f} | "
                f"{simulated_step_time(split_backward(one_f_one_b(p, m)), costs, m):.1f} | "
                f"{zb_text} | {simulated_step_time(compact, costs, m):.1f} | "
                f"{'/'.join(str(peaks[s]) for s in range(p))} |"
            )
    print("\n* ZB-H1 holds more micro-batches in flight than these caps allow.")


if __name__ == "__main__":
    main()
