"""Wait until named nodes are alive in a Ray cluster: ``python -m hybridflow.tools.ray_nodes --address
HOST:PORT --expect node1,node2 --timeout 180``. Polls (no fixed sleep); exit 0 once all are there, else
exit 1 with one line naming the nodes that never registered."""

from __future__ import annotations

import argparse
import sys
import time


def alive_names() -> set[str]:
    import ray

    return {n.get("NodeName") or n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hybridflow.tools.ray_nodes", description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--expect", required=True, help="comma-separated node names (ray start --node-name)")
    ap.add_argument("--timeout", type=float, default=180)
    args = ap.parse_args(argv)
    expect = set(filter(None, args.expect.split(",")))
    deadline = time.monotonic() + args.timeout

    import ray

    while True:  # the head itself may still be starting
        try:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError) as e:
            if time.monotonic() > deadline:
                print(f"error: no Ray head at {args.address} after {args.timeout:g}s ({e})", file=sys.stderr)
                return 1
            time.sleep(1)
    try:
        while not expect <= (have := alive_names()):
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(expect - have))
                print(f"error: nodes {missing} did not register with the Ray head at {args.address} within "
                      f"{args.timeout:g}s (registered: {', '.join(sorted(have)) or 'none'}); see their Ray logs "
                      "under the job's temp dir on each node", file=sys.stderr)
                return 1
            time.sleep(0.5)
    finally:
        ray.shutdown()
    print(f"ray: {len(expect)} nodes up: {', '.join(sorted(expect))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
