"""The Builder's methods and operator signatures against PopART's own (written from its source)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import popart_kit as pk
from popart_kit._model import builder as builder_module
from popart_kit._model.onnx_ops import signatures

OPS = json.loads((Path(__file__).with_name("popart_builder_ops.json")).read_text())
API = json.loads((Path(__file__).with_name("popart_api.json")).read_text())
# Operators whose attributes are subgraphs: PopART takes sub-builders; popart_kit refuses them.
SUBGRAPH_OPS = {"logical_if", "loop", "scan"}


def _same(ours: object, theirs: object) -> bool:
    if isinstance(theirs, float) and isinstance(ours, float):
        return abs(ours - theirs) <= 1e-6 * max(1.0, abs(theirs))
    return ours == theirs


@pytest.mark.parametrize("version", OPS["bound_ai_onnx_opsets"])
def test_every_ai_onnx_method_has_popart_s_signature(version):
    ours = signatures(version)
    theirs = OPS["ai_onnx"][str(version)]
    assert set(theirs) - set(ours) == SUBGRAPH_OPS & set(theirs)
    for name, spec in theirs.items():
        if name in SUBGRAPH_OPS:
            continue
        params = ours[name].signature.parameters
        assert list(params) == spec["params"], name
        for param, default in spec.get("defaults", {}).items():
            assert _same(params[param].default, default), (name, param)
        for param in set(spec["params"]) - set(spec.get("defaults", {})):
            assert params[param].default is inspect.Parameter.empty, (name, param)
        assert ("list[str]" if ours[name].returns_list else "str") == spec["returns"], name


def test_default_opset_is_popart_s():
    assert OPS["default_ai_onnx_opset"] == builder_module.DEFAULT_AI_ONNX_OPSET


@pytest.mark.parametrize("method", ["nllloss", "identityloss", "gelu"])
def test_graphcore_methods_have_popart_s_signature(method):
    ours = inspect.signature(getattr(pk.Builder().aiGraphcore, method))
    spec = OPS["ai_graphcore"][method]
    assert list(ours.parameters) == spec["params"]
    for param, default in spec["defaults"].items():
        value = ours.parameters[param].default
        assert (f"ReductionType.{value.name}" if isinstance(value, pk.ReductionType)
                else value) == default


def test_l1loss_takes_lambda_as_popart_does():
    spec = OPS["ai_graphcore"]["l1loss"]
    assert spec["params"] == ["args", "lambda", "reduction", "debugContext"]
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    b.aiGraphcore.l1loss([x], 0.5)
    b.aiGraphcore.l1loss([x], 0.5, pk.ReductionType.Sum, "named")
    b.aiGraphcore.l1loss([x], **{"lambda": 0.5, "reduction": pk.ReductionType.NoReduction})
    with pytest.raises(TypeError):
        b.aiGraphcore.l1loss([x], 0.5, lamda=1.0)


BUILDER_METHODS = ["nameScope", "getNameScope", "addInputTensor", "addInitializedInputTensor",
                   "addOutputTensor",
                   "getModelProto", "saveModelProto", "getInputTensorIds", "getOutputTensorIds",
                   "getTensorShape", "getTensorDtypeString", "pipelineStage", "virtualGraph",
                   "getPipelineStage", "hasPipelineStage", "getVirtualGraph", "hasVirtualGraph",
                   "addNodeAttribute", "nodeHasAttribute", "getInt64NodeAttribute"]


def test_builder_methods_are_popart_s():
    popart_methods = set(API["classes"]["Builder"]["methods"])
    assert set(BUILDER_METHODS) <= popart_methods
    for name in BUILDER_METHODS:
        assert callable(getattr(pk.Builder(), name))
    overloads = API["classes"]["Builder"]["overloads"]
    for name in ("addNodeAttribute", "nodeHasAttribute", "getInt64NodeAttribute",
                 "addOutputTensor", "saveModelProto"):
        ours = list(inspect.signature(getattr(pk.Builder(), name)).parameters)
        assert ours in overloads[name], name


def test_tensor_info_methods_are_popart_s():
    popart_methods = set(API["classes"]["TensorInfo"]["methods"])
    assert {"shape", "rank", "nelms", "dataType", "data_type_lcase"} <= popart_methods


def test_input_settings_keyword_is_popart_s_spelling():
    assert ["relicatedStreamMode"] in API["classes"]["InputSettings"]["ctor"]
    assert list(inspect.signature(pk.InputSettings).parameters) == ["relicatedStreamMode"]
    assert {"Broadcast", "Replicate"} == set(API["enums"]["ReplicatedStreamMode"])
    assert {m.name for m in pk.ReplicatedStreamMode} == set(API["enums"]["ReplicatedStreamMode"])
    assert {m.name for m in pk.ReductionType} == set(API["enums"]["ReductionType"])


@pytest.mark.parametrize("method, ours", [
    ("addInputTensor", builder_module._ADD_INPUT),
    ("pipelineStage", builder_module._PIPELINE_STAGE),
    ("virtualGraph", builder_module._VIRTUAL_GRAPH),
])
def test_overloads_are_popart_s(method, ours):
    theirs = API["classes"]["Builder"]["overloads"][method]
    assert sorted(list(sig.parameters) for sig, _ in ours) == sorted(theirs)


def test_name_scope_is_popart_s():
    assert "nameScope" in API["classes"]["Builder"]["methods"]
    assert "getNameScope" in API["classes"]["Builder"]["methods"]
    assert [list(inspect.signature(pk.Builder().nameScope).parameters)] == (
        API["classes"]["Builder"]["overloads"]["nameScope"])


def test_every_builder_method_and_ai_graphcore_operator_popart_has_is_here():
    """Walks the recorded API: each is implemented, or refuses with the reason (a
    BuilderError naming the fix) - none is missing."""
    b = pk.Builder()
    assert [m for m in API["classes"]["Builder"]["methods"] if not hasattr(b, m)] == []
    assert [m for m in OPS["ai_graphcore"] if not hasattr(b.aiGraphcore, m)] == []
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with pytest.raises(pk.BuilderError, match="Fix: "):
        b.aiGraphcore.packedDataBlock([x], [2], 2, 1, pk.Builder())
