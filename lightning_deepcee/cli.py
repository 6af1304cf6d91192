"""Command-line entry point ``deepcee``.

deepcee consolidate CHECKPOINT_DIR OUT.pt   merge a sharded pipeline checkpoint
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from lightning_deepcee.checkpoint import consolidate_checkpoint

    state = consolidate_checkpoint(args.checkpoint)
    torch.save(state, args.output)
    num = sum(v.numel() for v in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {num:,} values")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepcee", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser(
        "consolidate", help="merge a sharded pipeline checkpoint into one plain state_dict"
    )
    cons.add_argument("checkpoint", help="checkpoint directory (with meta.pt and stage_NNN.pt)")
    cons.add_argument("output", help="output file for torch.save(state_dict)")
    cons.set_defaults(func=_consolidate)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError) as exc:
        print(f"deepcee {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
