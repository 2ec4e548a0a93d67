"""`hf-dp-balance` command: one sub-command per job, each implemented by its own module.

Every sub-command module exposes `add_arguments(parser)` and `run(args) -> int`;
it is imported only when chosen, so `hf-dp-balance simulate` never loads torch.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

SUBCOMMANDS = {
    "demo": ("hf_dp_balance.apps.demo", "train a tiny Qwen2-VL three ways on 4 gloo ranks and compare"),
    "simulate": ("hf_dp_balance.apps.simulate", "what-if gain at DP 8..4096 on realistic data mixes"),
    "fit": ("hf_dp_balance.apps.fit", "fit a cost model from recorded timings (JSON)"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="hf-dp-balance", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.print_help()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nhf-dp-balance: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    name = argv[0]
    module = import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"hf-dp-balance {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
