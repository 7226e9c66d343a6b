"""vllm-router with every route keyed: the router that `pagoda serve --data-parallel-size N` runs on loopback.

vllm-router's command line has no flag that guards its own routes: `/add_worker`, `/remove_worker`,
`/list_workers`, `/workers` and `/flush_cache` answer whoever reaches its port, and its `--api-key` only names
the key it sends to workers. Its Rust core does check the bearer token of every request, `/health` and the
admin routes included, when it is given `api_key_validation_urls` (a constructor argument of
`vllm_router_rs.Router` that the `vllm-router` command does not expose): a token is valid if one of those
URLs answers it 200. Here they are the replicas' `/v1/models`, which answer only the worker secret, so a local
user who finds the router's port can neither add a worker of their own nor remove ours.

The secret comes from the environment, never the command line, which every user of the host can read. The
router caches each token's verdict for its whole life, a refusal too: the launcher's first call, made once
every replica is healthy, is what makes the secret valid for good.

Run as `python -m pagoda.entrypoints.server.keyed_router VLLM_ROUTER_FLAGS...` with PAGODA_WORKER_SECRET set.
"""
from __future__ import annotations

import os
import sys

WORKER_SECRET_ENV = "PAGODA_WORKER_SECRET"


def validation_urls(worker_urls: list[str]) -> list[str]:
    """Where the router checks a token: a keyed route of each replica that costs nothing to answer."""
    return [f"{u.rstrip('/')}/v1/models" for u in worker_urls]


def main(argv: list[str]) -> int:
    secret = os.environ.get(WORKER_SECRET_ENV)
    if not secret:
        print(f"keyed_router: {WORKER_SECRET_ENV} is not set", file=sys.stderr)
        return 2
    import vllm_router_rs
    from vllm_router.launch_router import launch_router, parse_router_args

    if "api_key_validation_urls" not in (vllm_router_rs.Router.__text_signature__ or ""):
        print("keyed_router: this vllm-router cannot check tokens on its routes (api_key_validation_urls); "
              "install vllm-router>=0.1.17,<0.2", file=sys.stderr)
        return 2
    args = parse_router_args(argv)
    if args.mini_lb:  # vllm-router's Python load balancer, which checks no token
        print("keyed_router: --mini-lb checks no token and is not allowed here", file=sys.stderr)
        return 2
    args.api_key = secret  # what it sends to workers on the routes where it does not pass the caller's header
    # Router.from_args hands every attribute of RouterArgs to the Rust constructor, this one included.
    args.api_key_validation_urls = validation_urls(args.worker_urls)  # type: ignore[attr-defined]
    launch_router(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
