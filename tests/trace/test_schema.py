"""`sidecar.trace.schema` is the trace's one contract: every attribute and level name the product
uses is declared there and spelled nowhere else, its version is the migrations' latest, and
docs/trace-schema.md's tables are generated from it."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.trace import schema
from sidecar.trace.migrations import MIGRATIONS
from tests.trace import schema_literals
from tests.trace.schema_literals import Use

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "trace-schema.md"
BEGIN = "<!-- generated: python -m sidecar.trace.schema --markdown -->\n"
END = "<!-- end generated -->\n"

# Modules whose `attrs` are another contract's keys, not a trace's
NOT_TRACE_ATTRIBUTES = {
    # a TensorFlow graph node's attributes (strides, padding, transpose_a, ...)
    "sidecar/profiling/runners/tf_ops.py",
    # the OTLP export's own `xsp.*` keys (docs/contracts.md), written to a collector
    "sidecar/trace/otlp_export.py",
}
# Modules the guard does not read for literals: the schema itself
SCHEMA_MODULE = "sidecar/trace/schema.py"
# Literals that spell an attribute's name but mean something else (path prefix -> names)
OTHER_MEANINGS: dict[str, tuple[str, ...]] = {
    # the relay's own call fields, metric labels and hook names (`proxy` may not import trace:
    # `sampling` turns them into the request span's attributes)
    "sidecar/proxy/": (
        "request_bytes",
        "response_bytes",
        "grpc_code",
        "stream_message",
        "protocol",  # also the metric families' label (grpc | http)
    ),
    # TF-Serving REST's own JSON key (the request's signature)
    "sidecar/backends/tf_rest_decode.py": ("signature_name",),
    # CUPTI activity records' own field names
    "sidecar/profiling/gpu/cupti_tracer.py": (
        "correlation_id",
        "graph_id",
        "graph_node_id",
        "copy_kind",
    ),
    # config.pbtxt's own field names (the protobuf's, a config's setting path)
    "sidecar/profiling/server_config.py": ("max_batch_size", "dynamic_batching"),
    "sidecar/profiling/python_backend/loader.py": ("max_batch_size",),
    "sidecar/commands/profile.py": ("model_path",),  # the command's positional argument
    # the analyses' own columns and keys: the report header's batch sizes, the live
    # breakdown's TensorFlow phase, the GPU timeline's kernel time, an analysis' memo key
    "analysis/analyses/compare.py": ("batch_sizes",),
    "analysis/report.py": ("batch_sizes",),
    "analysis/analyses/live.py": ("tf_ops",),
    "analysis/analyses/time_breakdown.py": ("kernel_ns",),
    "analysis/analyses/ensemble_steps.py": ("ensemble_steps", "step_index"),
    "analysis/analyses/layer_level.py": ("step_index",),  # a replayed step's order, computed
    "sidecar/profiling/runners/python_model.py": ("python_backend",),  # the runner's name
}


def _other_meaning(rel: str, name: str) -> bool:
    return any(rel.startswith(p) and name in names for p, names in OTHER_MEANINGS.items())


@functools.cache
def _uses() -> list[Use]:
    return [
        u
        for u in schema_literals.all_uses(REPO)
        if u.path != SCHEMA_MODULE
        and not (u.what == "attribute" and u.path in NOT_TRACE_ATTRIBUTES)
    ]


def _where(uses: list[Use]) -> str:
    return "\n".join(f"  {u.path}:{u.line}: {u.what} {u.name!r}" for u in uses)


def test_schema_version_is_the_latest_migration() -> None:
    assert MIGRATIONS.latest_version == schema.SCHEMA_VERSION


def test_every_attribute_and_level_used_is_declared() -> None:
    levels = {str(v) for v in schema.Level}
    undeclared = [
        u
        for u in _uses()
        if (u.what == "level" and u.name not in levels)
        or (u.what == "attribute" and u.name not in schema.ATTRIBUTES)
    ]
    assert not undeclared, "declare these in sidecar/trace/schema.py:\n" + _where(undeclared)


def test_no_attribute_or_level_is_spelled_outside_the_schema() -> None:
    spelled = [u for u in _uses() if u.name in schema.ATTRIBUTES or u.what == "level"]
    assert not spelled, "use sidecar.trace.schema's names:\n" + _where(spelled)


def _compound_literals(path: Path) -> list[tuple[int, str]]:
    """String literals (docstrings left out) that are a declared attribute name with an
    underscore: such a name means the attribute wherever it is spelled (one word, like
    `model` or `flops`, is a column's or a field's name as well: only its uses as an
    attribute's key are checked, above)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and id(n) not in docstrings
        and isinstance(n.value, str)
        and "_" in n.value
        and n.value in schema.ATTRIBUTES
    ]


def test_no_attribute_name_is_repeated_as_a_literal() -> None:
    found = [
        f"  {rel}:{line}: {value!r}"
        for f in schema_literals.sources(REPO)
        if (rel := str(f.relative_to(REPO))) != SCHEMA_MODULE
        for line, value in _compound_literals(f)
        if not _other_meaning(rel, value)
    ]
    assert not found, "use sidecar.trace.schema's names:\n" + "\n".join(found)


def test_the_guard_finds_a_spelled_attribute_and_level(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f(span, conn):\n"
        "    span.attributes['relay_response_start_ns'] = 1\n"
        "    attrs = {'not_in_schema': 2}\n"
        "    conn.execute(\"SELECT json_extract(attributes, '$.op_type') FROM spans "
        "WHERE level = 'layre'\")\n"
        "    return span.level == 'kernel', span.attributes.get('flops')\n"
    )
    found = {(u.what, u.name) for u in schema_literals.uses(source, "m.py")}
    assert found == {
        ("attribute", "relay_response_start_ns"),
        ("attribute", "not_in_schema"),
        ("attribute", "op_type"),
        ("level", "layre"),
        ("level", "kernel"),
        ("attribute", "flops"),
    }
    assert _compound_literals(source) == [(2, "relay_response_start_ns")]


def _generated_section() -> str:
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lacks the generated section's markers"
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def test_the_doc_holds_the_generated_tables() -> None:
    assert _generated_section() == schema.markdown(), (
        "docs/trace-schema.md is out of date: replace its generated section with the output "
        "of `python -m sidecar.trace.schema --markdown`"
    )


def test_the_docs_attribute_tables_name_declared_keys() -> None:
    """The hand-written tables of attributes' objects (`replay_settings`, `server_config`,
    `fidelity`, ...) name keys the schema declares."""
    text = DOC.read_text()
    part = text[text.index("## Attributes (JSON keys)") : text.index("## Example queries")]
    keys = {
        name
        for line in part.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])
    }
    assert len(keys) > 20
    assert sorted(keys - set(schema.ATTRIBUTES)) == []


def test_the_command_prints_the_tables() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.trace.schema", "--markdown"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == schema.markdown()


@pytest.mark.parametrize("name", ["op_type", "server_batch_window", "relay_response_start_ns"])
def test_declared_names_are_their_values(name: str) -> None:
    assert getattr(schema, name.upper()) == name
    assert schema.json_path(name) == f"$.{name}"
