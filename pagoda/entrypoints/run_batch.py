"""`pagoda batch run IN.jsonl OUT.jsonl`: answer a file of OpenAI batch requests offline, in vLLM's run_batch
shape. Each line ({"custom_id", "method": "POST", "url", "body"}) goes to the route it names of an app that
serves no socket (server/batch_runner.py sends it in process), so it is checked and answered exactly as the
server would; OUT holds one result per line, in the input's order, refused lines included with their error."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagoda.entrypoints.engine_args import add_engine_args

    p.add_argument("input", help="JSONL of requests, one per line (OpenAI's batch input format)")
    p.add_argument("output", help="where the results go, one JSON line per input line, in order")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    add_engine_args(p)


async def _run(app: Any, engine: Any, lines: list[str], concurrency: int) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from pagoda.entrypoints.server.batch_runner import ENDPOINTS, line_of, run_lines
    from pagoda.entrypoints.server.serving_batches import in_process_client

    results: list[dict[str, Any]] = []
    progress = tqdm(total=len(lines), desc="batch", unit="req", file=sys.stderr, disable=None)

    def write(result: dict[str, Any], ok: bool) -> None:
        results.append(result)
        progress.update()

    engine.start()
    client, send = in_process_client(app, None)
    try:
        await run_lines("batch-offline", lines, ENDPOINTS, set(), send, concurrency, write)
    finally:
        progress.close()
        await client.aclose()
        await engine.shutdown(0)
    return sorted(results, key=line_of)


def main(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.engine_args import check_model, engine_kwargs

    src = Path(args.input)
    if not src.is_file():
        raise FileNotFoundError(f"no input file {src}")
    lines = [ln for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()]
    check_model(args.model)
    from pagoda.config import EngineConfig
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.engine.engine import LLMEngine
    from pagoda.entrypoints.server.app import ServerSettings, create_app
    from pagoda.entrypoints.server.args import served_names

    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    names, aliases = served_names(args.model, None)
    engine = AsyncEngine(LLMEngine(config))
    app = create_app(engine, ServerSettings(served_model_names=names, model_aliases=aliases))
    results = asyncio.run(_run(app, engine, lines, config.scheduler.max_num_seqs))
    tmp = Path(f"{args.output}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results), encoding="utf-8")
    os.replace(tmp, args.output)
    failed = sum(1 for r in results if r["error"] is not None or r["response"]["status_code"] != 200)
    print(f"pagoda batch: {len(results) - failed} answered, {failed} refused -> {args.output}", file=sys.stderr)
    return 0
