"""`pagoda serve --model A --model B ...` or `--models-dir DIR`: several models in one server.

Each model gets its own LLMEngine, step loop (AsyncEngine) and app (create_app), built when it loads
(models.py) and reached through the dispatcher (model_dispatcher.py). The engines share the process's
cores by taking turns at stepping, on one compute thread (StepTurns): each step runs on every compute thread,
and two models that both have work alternate step by step.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.engine.step_turns import StepTurns
from pagoda.entrypoints.server.models import LoadedModel, ModelSpec
from pagoda.entrypoints.server.settings import ServerSettings

_WEIGHT_SUFFIXES = (".safetensors", ".gguf")


def model_specs(paths: list[str], models_dir: str | None) -> list[ModelSpec]:
    """The models given one by one, then every model in `models_dir` (a folder with config.json, or a .gguf
    file), each named as a single server names it (its folder's or file's base name)."""
    from pagoda.entrypoints.server.args import served_names

    found = list(paths)
    if models_dir is not None:
        folder = Path(models_dir)
        if not folder.is_dir():
            raise ValueError(f"--models-dir {models_dir!r} is not a folder")
        for entry in sorted(folder.iterdir()):
            if (entry.is_dir() and (entry / "config.json").is_file()) or \
                    (entry.is_file() and entry.name.lower().endswith(".gguf")):
                found.append(str(entry))
        if len(found) == len(paths):
            raise ValueError(f"--models-dir {models_dir!r} holds no model (a folder with config.json, or a .gguf)")
    specs: list[ModelSpec] = []
    for path in found:
        names, aliases = served_names(path, None)
        clash = next((s for s in specs if s.name == names[0]), None)
        if clash is not None:
            raise ValueError(f"two models are named {names[0]!r}: {clash.path} and {path} (rename one)")
        specs.append(ModelSpec(names[0], path, tuple(aliases)))
    return specs


def weight_file_bytes(path: str) -> int:
    """The size of a model's weight files: a .gguf, or a folder's *.safetensors (and any .gguf in it)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.glob("*") if f.name.endswith(_WEIGHT_SUFFIXES) and f.is_file())


@dataclass
class EngineModelLoader:
    """Builds a generating model's engine and app (models.ModelLoader)."""
    engine_kwargs: dict[str, Any]
    settings: ServerSettings  # the server's; each model's app gets a copy that names it
    batch_model: str  # the model whose app keeps /v1/files and /v1/batches (the default one)
    step_turns: StepTurns = field(default_factory=StepTurns)
    measured: dict[str, int] = field(default_factory=dict)  # resident bytes of each model's last load

    def estimate_bytes(self, spec: ModelSpec) -> int:
        """What the model took the last time it loaded; before that, its weight files and its KV pool: the
        pool's size given (--kv-cache-memory), else the most the engine's default would take."""
        if spec.name in self.measured:
            return self.measured[spec.name]
        import psutil

        from pagoda.config import CacheConfig, parse_memory

        kv = parse_memory(self.engine_kwargs.get("kv_cache_memory"))
        if kv is None:
            cache = CacheConfig()
            kv = int(min(psutil.virtual_memory().available * cache.memory_fraction, cache.max_default_bytes))
        return weight_file_bytes(spec.path) + kv

    def load(self, spec: ModelSpec) -> LoadedModel:
        from pagoda.config import EngineConfig
        from pagoda.engine.async_engine import AsyncEngine
        from pagoda.engine.engine import LLMEngine
        from pagoda.entrypoints.server.app import create_app
        from pagoda.entrypoints.server.metrics import ServerMetrics

        config = EngineConfig.from_kwargs(spec.path, **self.engine_kwargs)
        metrics = ServerMetrics(spec.name)
        async_engine = AsyncEngine.launch(lambda: LLMEngine(config), metrics, step_turns=self.step_turns)
        engine = async_engine.engine
        metrics.set_cache_config(config.cache.block_size, config.cache.kv_cache_dtype,
                                 config.cache.enable_prefix_caching, engine.kv.pool.num_blocks)
        settings = dataclasses.replace(
            self.settings, served_model_names=[spec.name], model_aliases=list(spec.aliases), model_root=spec.path,
            batch_dir=self.settings.batch_dir if spec.name == self.batch_model else None)
        app = create_app(async_engine, settings, metrics)

        @contextlib.asynccontextmanager
        async def lifespan() -> AsyncIterator[None]:
            try:
                async with app.router.lifespan_context(app):
                    yield
            finally:
                engine.structured.close()  # its grammar compile workers
                forget_endpoints()

        def begin_shutdown(timeout: float) -> None:
            async_engine.begin_shutdown(timeout)
            engine.structured.close()

        resident = resident_bytes(engine, weight_file_bytes(spec.path))
        self.measured[spec.name] = resident
        return LoadedModel(app=app, lifespan=lifespan, resident_bytes=resident, max_model_len=engine.max_model_len,
                           metrics=metrics.registry, begin_shutdown=begin_shutdown)


def resident_bytes(engine: Any, weight_files: int) -> int:
    """The engine's weights as loaded (quantized, cast: not the files' size) and its KV pool; a tensor-parallel
    engine holds its weights in other processes, so the files stand in for them."""
    model = getattr(engine.runner, "model", None)
    weights = weight_files
    if model is not None:
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return weights + engine.kv.pool.num_blocks * engine.runner.kv_bytes_per_block()


def forget_endpoints() -> None:
    """Empty FastAPI's module-level caches of what kind of callable each endpoint is: they are keyed by the
    endpoint functions, closures over their model's engine, and would keep an unloaded model in memory."""
    from fastapi.dependencies import models as dependencies

    for cached in vars(dependencies).values():
        if callable(getattr(cached, "cache_clear", None)):
            cached.cache_clear()


def check_args(args: argparse.Namespace) -> None:
    """Flags that mean one model per server."""
    for given, flag in ((args.data_parallel_size != 1, "--data-parallel-size"),
                        ((args.tensor_parallel_size or 1) != 1, "--tensor-parallel-size"),
                        (args.task != "generate", "--task"), (args.embedding_model is not None, "--embedding-model"),
                        (args.served_model_name is not None, "--served-model-name")):
        if given:
            raise ValueError(f"{flag} serves one model: it cannot be used with several models (--model given twice "
                             "or --models-dir)")


def main(args: argparse.Namespace, paths: list[str], settings: ServerSettings) -> int:
    """Serve every model of `paths` and --models-dir behind one dispatcher (cli.main's single-model path
    otherwise)."""
    from pagoda.config import parse_memory
    from pagoda.entrypoints.engine_args import engine_kwargs
    from pagoda.entrypoints.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
    from pagoda.entrypoints.server.model_dispatcher import ModelDispatcher
    from pagoda.entrypoints.server.models import ModelRegistry
    from pagoda.entrypoints.server.run import run_server
    from pagoda.entrypoints.server.settings import ModelsSettings

    check_args(args)
    specs = model_specs(paths, args.models_dir)
    budget = parse_memory(args.models_memory)
    if budget is not None and budget <= 0:
        raise ValueError("--models-memory must be positive")
    if args.models_idle_unload is not None and not 0 < args.models_idle_unload < float("inf"):
        raise ValueError("--models-idle-unload must be a positive number of seconds")
    models = ModelsSettings(memory_budget=budget, idle_unload_s=args.models_idle_unload, preload=args.preload)
    loader = EngineModelLoader(engine_kwargs(args), settings, batch_model=specs[0].name)
    registry = ModelRegistry(specs, loader, models)
    dispatcher = ModelDispatcher(registry)
    app: Any = BodyLimitMiddleware(dispatcher, max_bytes=settings.max_request_body_bytes,
                                   uploads=(("/v1/files",), settings.max_upload_bytes))
    if settings.api_key:
        app = APIKeyMiddleware(app, settings.api_key)
    return run_server(app, args, dispatcher.begin_shutdown, ", ".join(s.name for s in specs))
