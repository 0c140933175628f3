"""The SDK follows docs/openapi.json: its models are the generated ones
(regenerated here and compared), and every operation is called by an SDK
method or left out on purpose — so an API change fails this suite until
the SDK follows it. And the sync client is the one generated from the
async one."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any, Callable, Dict, Set

import pytest

import clade
from clade import _api
from clade import _generated as gen
from conftest import REPO, SDK_DIR

OPENAPI = REPO / "docs" / "openapi.json"


def _operation_ids() -> Set[str]:
    spec = json.loads(OPENAPI.read_text())
    return {op["operationId"] for ops in spec["paths"].values() for op in ops.values() if isinstance(op, dict) and "operationId" in op}


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, SDK_DIR / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_models_match_docs_openapi_json() -> None:
    committed = (SDK_DIR / "src" / "clade" / "_generated.py").read_text()
    assert _script("generate_models").generate(OPENAPI) == committed, "run: python3 sdk/python/scripts/generate_models.py"


def test_the_sync_client_is_the_one_generated_from_the_async_one() -> None:
    outputs = _script("generate_sync").outputs()
    assert outputs, "generate_sync.py names no files"
    for path, expected in outputs.items():
        assert path.read_text() == expected, f"{path.name} is stale or edited by hand: run python3 sdk/python/scripts/generate_sync.py"


def _parameters(function: Callable[..., Any]) -> Set[str]:
    return set(inspect.signature(function).parameters)


@pytest.mark.parametrize(
    "schema, method, renamed",
    [
        (gen.CreateSandboxBody, clade.Sandboxes.create, {}),
        (gen.CreateVolumeBody, clade.Volumes.create, {}),
        (gen.CreateDatabaseBody, clade.Databases.create, {}),
        (gen.CloneBody, clade.Databases.clone, {}),
        (gen.PatchDatabaseBody, clade.Databases.update, {}),
        (gen.CreateFunctionBody, clade.Functions.create, {}),
        (gen.PatchFunctionBody, clade.Functions.update, {}),
        (gen.InvokeBody, clade.Functions.invoke, {}),
        (gen.RecordRunBody, clade.Functions.record_run, {}),
        (gen.CreateScheduleBody, clade.Schedules.create, {}),
        (gen.PatchScheduleBody, clade.Schedules.update, {}),
        (gen.AppBody, clade.Apps.create, {}),
        (gen.AppBody, clade.Apps.update, {}),
        (gen.DeployBody, clade.Apps.deploy, {}),
        (gen.SetEnvBody, clade.Apps.set_env, {}),
        (gen.ImportEnvBody, clade.Apps.import_env, {}),
        (gen.CreateToken, clade.Keys.create, {"name": "label"}),
        (gen.ExecBody, clade.Sandbox.exec, {"timeout_seconds": "timeout"}),
        (gen.ExecBody, clade.Sandbox.exec_stream, {"timeout_seconds": "timeout"}),
    ],
)
def test_request_bodies_have_every_field_as_an_argument(schema: Any, method: Callable[..., Any], renamed: Dict[str, str]) -> None:
    """A field added to a request body fails here until the method takes it."""
    fields = {renamed.get(f.name, f.name) for f in dataclasses.fields(schema)}
    for client_method in (method, getattr(getattr(clade, "Async" + method.__qualname__.split(".")[0]), method.__name__)):
        missing = fields - _parameters(client_method)
        assert not missing, f"{client_method.__qualname__} lacks {sorted(missing)} of {schema.__name__}"


def test_every_operation_is_covered_or_excluded_on_purpose() -> None:
    operations = _operation_ids()
    covered, excluded = set(_api.OPERATIONS), set(_api.NOT_COVERED)
    assert not covered & excluded, f"both covered and excluded: {sorted(covered & excluded)}"
    missing = operations - covered - excluded
    assert not missing, f"operations of docs/openapi.json the SDK does not call: {sorted(missing)}"
    stale = (covered | excluded) - operations
    assert not stale, f"operations the SDK names that docs/openapi.json no longer has: {sorted(stale)}"


def _resolve(root: Any, dotted: str) -> Any:
    target = root
    for part in dotted.split("."):
        target = getattr(target, part)
    return target


def test_every_covered_operation_has_its_method_on_both_clients() -> None:
    sync_owners = {"Sandbox": clade.Sandbox, "CodeContext": clade.CodeContext, "Files": clade.Files,
                   "Network": clade.Network, "Limits": clade.Limits, "Ports": clade.Ports}
    async_owners = {"Sandbox": clade.AsyncSandbox, "CodeContext": clade.AsyncCodeContext, "Files": clade.AsyncFiles,
                    "Network": clade.AsyncNetwork, "Limits": clade.AsyncLimits, "Ports": clade.AsyncPorts}
    sync_client = clade.Clade(api_key="k", api_url="http://127.0.0.1:9")
    async_client = clade.AsyncClade(api_key="k", api_url="http://127.0.0.1:9")
    for operation, method in _api.OPERATIONS.items():
        owner, _, name = method.partition(".")
        for owners, client in ((sync_owners, sync_client), (async_owners, async_client)):
            target = _resolve(owners[owner], name) if owner in owners else _resolve(client, method)
            assert callable(target), f"{operation}: {method} is not a method of {type(client).__name__}"
    sync_client.close()


def test_every_call_builder_names_a_known_operation() -> None:
    known = set(_api.OPERATIONS)
    assert _api.get_sandbox("x").operation in known
    sources = (Path(_api.__file__)).read_text()
    for operation in _operation_ids() - set(_api.NOT_COVERED):
        assert f'"{operation}"' in sources.split("NOT_COVERED")[1], f"no Call is built for {operation}"
