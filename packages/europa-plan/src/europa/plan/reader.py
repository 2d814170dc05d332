"""Reading a runs file (``[[generation]]``, ``[[gpu]]``, ``[[model]]`` and ``[[run]]``
tables, the format of ``benchmarks/published_runs.toml``) into ``europa.plan.record``'s
records.

Everything is checked before anything is computed, and each refusal is one
``PlanInputError`` line naming the file, the table, the key, the value and what was
expected: an unknown key anywhere, a wrong type (``europa.plan.keys`` holds each table's
keys and their checks), a missing or unknown model or gpu, a layout that does not
multiply out or divide. A ``model`` or ``gpu`` may name a built-in
(``europa.plan.builtin``); a table of the file with the same ``id`` overrides the keys it
states.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from europa.plan.errors import PlanInputError
from europa.plan.keys import (
    FAMILY_OPTIONAL,
    FAMILY_REQUIRED,
    GENERATION_OPTIONAL,
    GENERATION_REQUIRED,
    GPU_OPTIONAL,
    GPU_REQUIRED,
    MODEL_OPTIONAL,
    MODEL_REQUIRED,
    NOT_ASSUMED,
    RUN_OPTIONAL,
    RUN_REQUIRED,
    BadValue,
)
from europa.plan.record import (
    FAMILIES,
    PRECISION_PEAK,
    Efficiencies,
    Gpu,
    Layout,
    Model,
    Published,
    Run,
)


@dataclass(frozen=True)
class RunsFile:
    """What a runs file defines: its GPU generations, GPUs and models (built-ins included)
    and its runs."""

    generations: Mapping[str, Efficiencies]
    gpus: Mapping[str, Gpu]
    models: Mapping[str, Model]
    runs: tuple[Run, ...]

    def run(self, run_id: str) -> Run:
        for run in self.runs:
            if run.id == run_id:
                return run
        known = ", ".join(r.id for r in self.runs)
        raise PlanInputError(f'--run "{run_id}": no such run; expected one of: {known}')


# --- the reader ---------------------------------------------------------------------------


class Where:
    """Where a refusal points: the file and the table."""

    def __init__(self, path: str, table: str) -> None:
        self.path, self.table = path, table

    def error(self, key: str, value: Any, expected: str) -> PlanInputError:
        shown = value if isinstance(value, int | float) else f'"{value}"'
        if isinstance(value, dict | list):
            shown = str(value)
        return PlanInputError(f"{self.path}: {self.table}: {key} = {shown}: expected {expected}")

    def fields(
        self, table: Mapping[str, Any], required: Mapping, optional: Mapping
    ) -> dict[str, Any]:
        """The table's keys, each checked; unknown and missing keys refused."""
        for key in table:
            if key not in required and key not in optional:
                known = ", ".join([*required, *optional])
                raise PlanInputError(
                    f"{self.path}: {self.table}: unknown key {key}: expected one of {known}"
                )
        for key in required:
            if key not in table:
                raise PlanInputError(f"{self.path}: {self.table}: missing key {key}")
        out = {}
        for key, value in table.items():
            check = required.get(key) or optional[key]
            check = check[0] if isinstance(check, tuple) else check
            try:
                out[key] = check(value)
            except BadValue as bad:
                raise self.error(key, value, str(bad)) from None
        return out


def _load(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise PlanInputError(f"{path}: cannot be read: {err.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PlanInputError(
            f"{path}: not UTF-8: byte {err.start} is {raw[err.start]:#04x}"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PlanInputError(f"{path}: not TOML: {err}") from None


def _tables(path: Path, data: dict[str, Any], name: str) -> list[dict[str, Any]]:
    tables = data.get(name, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise PlanInputError(f"{path}: {name}: expected [[{name}]] tables")
    return tables


def _id(path: Path, kind: str, index: int, table: dict[str, Any]) -> str:
    value = table.get("id")
    if not isinstance(value, str) or not value or not value.isprintable():
        raise PlanInputError(
            f"{path}: {kind} #{index + 1}: id = {value!r}: expected a one-line printable string"
        )
    return value


def read_gpu(where: Where, table: Mapping[str, Any]) -> Gpu:
    return Gpu(**where.fields(table, GPU_REQUIRED, GPU_OPTIONAL))


def read_generation(where: Where, table: Mapping[str, Any]) -> Efficiencies:
    return Efficiencies(**where.fields(table, GENERATION_REQUIRED, GENERATION_OPTIONAL))


def read_model(where: Where, table: Mapping[str, Any]) -> Model:
    family = table.get("family")
    if family not in FAMILIES:
        raise where.error("family", family, "one of " + ", ".join(f'"{f}"' for f in FAMILIES))
    required = {**MODEL_REQUIRED, **FAMILY_REQUIRED[family]}
    values = where.fields(table, required, {**MODEL_OPTIONAL, **FAMILY_OPTIONAL[family]})
    if "dense_hidden_dim" in values:
        values["ffn_hidden_dim"] = values.pop("dense_hidden_dim")
    model = Model(**values)
    if model.moe:
        if model.top_k > model.num_experts:
            expected = f"at most num_experts = {model.num_experts}"
            raise where.error("top_k", model.top_k, expected)
        if model.n_dense_layers >= model.n_layers:
            expected = f"fewer than n_layers = {model.n_layers}"
            raise where.error("n_dense_layers", model.n_dense_layers, expected)
        if model.n_dense_layers and not model.ffn_hidden_dim:
            raise PlanInputError(
                f"{where.path}: {where.table}: missing key dense_hidden_dim "
                f"(n_dense_layers = {model.n_dense_layers})"
            )
    if model.family != "mla-moe" and model.n_heads % model.n_kv_heads:
        expected = f"a divisor of n_heads = {model.n_heads}"
        raise where.error("n_kv_heads", model.n_kv_heads, expected)
    return model


def read_run(
    where: Where, table: Mapping[str, Any], gpus: Mapping[str, Gpu], models: Mapping[str, Model]
) -> Run:
    values = where.fields(table, RUN_REQUIRED, RUN_OPTIONAL)
    model = models.get(values["model"])
    if model is None:
        raise where.error(
            "model", values["model"], "a [[model]] id or built-in: " + ", ".join(models)
        )
    gpu = gpus.get(values["gpu"])
    if gpu is None:
        raise where.error("gpu", values["gpu"], "a [[gpu]] id or built-in: " + ", ".join(gpus))
    moe_only = set() if model.moe else {"etp", "routing", "ep_dispatcher", "ep_overlap"}
    zero3 = values.get("optimizer_sharding") in ("fsdp", "hsdp")
    zero3_only = set() if zero3 else {"reshard_after_forward"}
    if "reshard_after_forward" in values and not zero3:
        raise where.error(
            "reshard_after_forward",
            values["reshard_after_forward"],
            'no value unless optimizer_sharding = "fsdp" or "hsdp"',
        )
    unasked = NOT_ASSUMED | moe_only | zero3_only
    assumed = [k for k in RUN_OPTIONAL if k not in values and k not in unasked]
    get = lambda key: values.get(key, RUN_OPTIONAL[key][1])  # noqa: E731
    tp, cp, pp, vp = get("tp"), get("cp"), get("pp"), get("vp")
    dp = values.get("dp") or max(1, values["gpus"] // (tp * cp * pp))
    schedule = get("pipeline_schedule") or ("interleaved" if vp > 1 else "1f1b")
    layout = Layout(
        tp=tp,
        sequence_parallel=values.get("sequence_parallel", tp > 1),
        cp=cp,
        pp=pp,
        vp=vp,
        schedule=schedule,
        dp=dp,
        dp_kind=get("optimizer_sharding"),
        dp_shard=values.get("dp_shard", 0),
        ep=get("ep"),
        etp=get("etp"),
        recompute=get("recompute"),
    )
    run = Run(
        id=values["id"],
        model=model,
        gpu=gpu,
        gpus=values["gpus"],
        precision=values["precision"],
        seq_len=values["seq_len"],
        global_batch=values["global_batch"],
        micro_batch=get("micro_batch"),
        layout=layout,
        optimizer=get("optimizer"),
        state_dtype=get("state_dtype"),
        routing=get("routing"),
        ep_dispatcher=get("ep_dispatcher"),
        ep_overlap=get("ep_overlap"),
        reshard_after_forward=get("reshard_after_forward"),
        flops_convention=get("flops_convention"),
        published=values.get("published") or Published(),
        assumed=tuple(assumed),
        source=values.get("source"),
        quote=values.get("quote"),
        notes=values.get("notes"),
    )
    check_run(where, run)
    return run


def check_run(where: Where, run: Run) -> None:
    """The layout against the model, the GPU count and the batch."""
    lay, model = run.layout, run.model
    if lay.gpus != run.gpus:
        product = f"tp × cp × pp × dp = {lay.tp} × {lay.cp} × {lay.pp} × {lay.dp} = {lay.gpus}"
        raise where.error("dp", lay.dp, f"{product} to equal gpus = {run.gpus}")
    group = lay.tp * lay.cp * lay.dp
    if model.moe and (group % (lay.ep * lay.etp) or model.num_experts % lay.ep):
        raise where.error(
            "ep",
            lay.ep,
            f"ep × etp (etp = {lay.etp}) to divide a stage's tp × cp × dp = {group} ranks "
            f"and ep to divide num_experts = {model.num_experts}",
        )
    if not model.moe and (lay.ep > 1 or lay.etp > 1):
        raise where.error("ep", lay.ep, f"1: model {model.id} has no experts")
    if lay.pp > model.n_layers:
        raise where.error("pp", lay.pp, f"at most n_layers = {model.n_layers}")
    held = lay.layers_per_stage(model.n_layers)
    if held % lay.vp:
        expected = f"a divisor of the {held} layers the fullest of pp = {lay.pp} stages holds"
        raise where.error("vp", lay.vp, expected)
    if lay.schedule in ("zbv", "dualpipev") and lay.vp != 2:
        raise where.error("vp", lay.vp, f"2: the {lay.schedule} schedule holds two stages a rank")
    if lay.vp > 1 and lay.schedule == "1f1b":
        raise where.error("pipeline_schedule", "1f1b", "a schedule with virtual stages (vp > 1)")
    kv_heads = model.n_heads if model.mla else model.n_kv_heads
    if model.n_heads % lay.tp or kv_heads % lay.tp:
        raise where.error("tp", lay.tp, f"a divisor of the model's {kv_heads} key/value heads")
    if run.seq_len % (2 * lay.cp if lay.cp > 1 else 1):
        raise where.error("seq_len", run.seq_len, f"a multiple of 2 × cp = {2 * lay.cp}")
    per_step = run.micro_batch * lay.dp
    if run.global_batch % per_step:
        expected = f"a multiple of micro_batch × dp = {run.micro_batch} × {lay.dp} = {per_step}"
        raise where.error("global_batch", run.global_batch, expected)
    if lay.dp_kind == "hsdp" and (not lay.dp_shard or lay.dp % lay.dp_shard):
        raise where.error("dp_shard", lay.dp_shard or "(missing)", f"a divisor of dp = {lay.dp}")
    if lay.dp_kind != "hsdp" and lay.dp_shard:
        raise where.error("dp_shard", lay.dp_shard, 'no value unless optimizer_sharding = "hsdp"')
    peak = PRECISION_PEAK[run.precision]
    if peak not in run.gpu.peak_tflops:
        raise where.error(
            "precision", run.precision, f"a precision gpu {run.gpu.id} has a peak for "
            f"(peak_tflops.{peak} is not given)"
        )  # fmt: skip
    if peak not in run.gpu.efficiencies.gemm:
        raise where.error(
            "precision", run.precision, f"a precision generation {run.gpu.generation} has a "
            f"GEMM efficiency for (gemm.{peak} is not given)"
        )  # fmt: skip


TABLES = ("generation", "gpu", "model", "run")
READERS: dict[str, Callable[[Where, Mapping[str, Any]], Any]] = {
    "generation": read_generation,
    "gpu": read_gpu,
    "model": read_model,
}


def read_runs(path: str | Path, builtin: Mapping[str, Sequence[Mapping[str, Any]]]) -> RunsFile:
    """Read and check a whole runs file. ``builtin`` holds the generation, gpu and model
    tables every file may name (``europa.plan.load_runs`` passes europa-plan's own); a
    file's table with the id of a built-in one overrides the keys it states."""
    return read_tables(_load(Path(path)), builtin, Path(path))


def read_tables(
    data: Mapping[str, Any], builtin: Mapping[str, Sequence[Mapping[str, Any]]], path: Path
) -> RunsFile:
    """``read_runs`` of a file already parsed (``path`` names it in a refusal)."""
    for key in data:
        if key not in TABLES:
            raise PlanInputError(
                f"{path}: unknown key {key} at the top: expected "
                + ", ".join(f"[[{t}]]" for t in TABLES)
                + " tables"
            )
    known: dict[str, dict[str, Any]] = {}
    for kind, read in READERS.items():
        tables = {t["id"]: dict(t) for t in builtin.get(kind, ())}
        seen: set[str] = set()
        for index, table in enumerate(_tables(path, data, kind)):
            name = _id(path, kind, index, table)
            if name in seen:
                raise PlanInputError(f'{path}: {kind} "{name}": id defined twice')
            seen.add(name)
            tables[name] = {**tables.get(name, {}), **table}
        known[kind] = {
            name: read(Where(str(path) if name in seen else "builtin.toml", f'{kind} "{name}"'), t)
            for name, t in tables.items()
        }
    for name, gpu in known["gpu"].items():
        if gpu.generation not in known["generation"]:
            expected = "a [[generation]] id: " + ", ".join(known["generation"])
            raise Where(str(path), f'gpu "{name}"').error("generation", gpu.generation, expected)
        known["gpu"][name] = replace(gpu, efficiencies=known["generation"][gpu.generation])
    runs, seen = [], set()
    for index, table in enumerate(_tables(path, data, "run")):
        name = _id(path, "run", index, table)
        if name in seen:
            raise PlanInputError(f'{path}: run "{name}": id defined twice')
        seen.add(name)
        where = Where(str(path), f'run "{name}"')
        runs.append(read_run(where, table, known["gpu"], known["model"]))
    return RunsFile(
        MappingProxyType(known["generation"]),
        MappingProxyType(known["gpu"]),
        MappingProxyType(known["model"]),
        tuple(runs),
    )
