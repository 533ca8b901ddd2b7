"""PipelineLayout on models made by hand with onnx.helper: every rule, depth, and the table."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from pydantic import ValidationError

import popart_kit as pk
from popart_kit._model.layout import PipelineLayout

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

Placement = tuple[int | None, int | None]  # (stage, ipu)


def chain(*placements: Placement, branch: Placement | None = None) -> onnx.ModelProto:
    """x -> relu0 -> relu1 -> ...; ``branch`` adds an op reading relu0's output."""
    nodes, prev = [], "x"

    def attrs(p: Placement) -> dict[str, int]:
        stage, ipu = p
        return ({} if stage is None else {"__pipeline_stage": stage}) | (
            {} if ipu is None else {"__ipu_number": ipu})

    for i, p in enumerate(placements):
        nodes.append(helper.make_node("Relu", [prev], [f"t{i}"], name=f"relu{i}", **attrs(p)))
        prev = f"t{i}"
    outputs = [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2])]
    if branch is not None:
        nodes.append(helper.make_node("Neg", ["t0"], ["b"], name="branch", **attrs(branch)))
        outputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [2]))
    nodes.insert(0, helper.make_node("Constant", [], ["c"], name="const",
                                     value=helper.make_tensor("v", TensorProto.FLOAT, [], [1.0])))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [2])], outputs)
    model = helper.make_model(graph)
    onnx.checker.check_model(model)
    return model


def rules(info) -> set[str]:
    return {e["type"].removeprefix("popart_kit.") for e in info.value.errors()}


def config(**kw) -> pk.SessionConfig:
    kw.setdefault("mode", "training")
    return pk.SessionConfig(**kw)


# -- reading ------------------------------------------------------------------------------------


def test_reads_a_model_proto_bytes_or_a_path(tmp_path):
    model = chain((0, 0), (1, 1))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    for source in (model, model.SerializeToString(), path, str(path)):
        layout = PipelineLayout.from_model(source)
        assert layout.forward_stages == 2 and layout.stage_ipu == {0: 0, 1: 1}
    with pytest.raises(TypeError, match="expected an onnx.ModelProto, bytes or a path"):
        PipelineLayout.from_model(3)


def test_unannotated_model():
    layout = PipelineLayout.from_model(chain((None, None), (None, None)))
    assert not layout.is_annotated and layout.forward_stages == 0 and layout.depth(True) == 0


# -- depth ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("placements, inference, training", [
    ([(0, 0), (1, 1), (2, 2)], 3, 5),          # three stages on three IPUs
    ([(0, 0), (1, 0), (2, 1)], 2, 3),          # stages 0 and 1 on one IPU merge
    ([(0, 0), (1, 1), (2, 0)], 3, 5),          # back to IPU 0: no neighbours share an IPU
    ([(0, 0), (1, 1), (2, 1), (3, 0)], 3, 5),  # 0,1,1,0 -> 0,1,0; training 0,1,1,0,1,1,0 -> 5
    ([(0, 0)], 1, 1),
])
def test_depth(placements, inference, training):
    layout = PipelineLayout.from_model(chain(*placements))
    assert layout.depth(training=False) == inference
    assert layout.depth(training=True) == training


def test_several_stages_on_one_ipu_and_stages_going_back_through_ipus():
    layout = PipelineLayout.from_model(chain((0, 1), (1, 0), (2, 1), (3, 0)))
    assert layout.stage_ipu == {0: 1, 1: 0, 2: 1, 3: 0}
    assert layout.ipus_used == {0, 1}
    assert layout.depth(True) == 7


def test_stages_inferred_from_ipus():
    layout = PipelineLayout.from_model(chain((None, 0), (None, 1), (None, 1)))
    assert layout.inferred and layout.forward_stages == 2 and layout.stage_ipu == {0: 0, 1: 1}


# -- the model's rules ----------------------------------------------------------------------------


PIPELINED = {"ipus_per_replica": 4, "accumulation": {"factor": 8}, "pipeline": {"enabled": True},
             "virtual_graph_mode": "manual"}


@pytest.mark.parametrize("model, rule, words", [
    (chain((0, 0), (None, 1)), "V4", "only some ops have a pipeline stage; 1 has none: relu1"),
    (chain((0, 0), (1, None)), "V26", "only some ops have an IPU; 1 has none: relu1"),
    (chain((0, 0), (2, 1)), "V8", "stage 1 is missing"),
    (chain((0, 0), (0, 1)), "V5", "stage 0 has ops on IPUs [0, 1]"),
    (chain((1, 0), (0, 1)), "P10", "tensor 't0' is made by relu0 on stage 1 but consumed by "
                                   "relu1 on stage 0"),
    (chain((None, 1), (None, 0)), "P9", "PopART takes each op's IPU as its stage"),
    (chain((0, 0), (1, 1), branch=(0, 0)), None, None),  # a branch in an earlier stage is fine
])
def test_model_rules_when_pipelining(model, rule, words):
    layout = PipelineLayout.from_model(model)  # no session yet: nothing to refuse
    if rule is None:
        layout.check(config(**PIPELINED))
        return
    with pytest.raises(ValidationError) as info:
        layout.check(config(**PIPELINED))
    assert rule in rules(info)
    assert words in str(info.value)


@pytest.mark.parametrize("model", [chain((0, 0), (2, 1)), chain((0, 0), (0, 1)),
                                   chain((1, 0), (0, 1)), chain((None, 1), (None, 0)),
                                   chain((0, 0), (None, 1))])
def test_stage_rules_apply_only_when_pipelining(model):
    """PopART checks stage annotations and the order data flows between stages or IPUs only
    when it pipelines (Ir::verifyPipelineSettings clears the stages otherwise): a model sharded
    over IPUs with data going back from IPU 1 to IPU 0 runs unpipelined."""
    layout = PipelineLayout.from_model(model)
    found = layout.problems(config(ipus_per_replica=2, virtual_graph_mode="manual"))
    assert not [p for p in found if p.severity == "error"], found


def test_ipus_on_some_ops_only_matter_with_virtual_graphs():
    layout = PipelineLayout.from_model(chain((None, 0), (None, None)))
    assert not [p for p in layout.problems(config()) if p.severity == "error"]
    assert "V26" in {p.rule for p in layout.problems(config(ipus_per_replica=2,
                                                            virtual_graph_mode="manual"))}


def test_negative_stages_are_refused_with_the_model():
    with pytest.raises(ValidationError) as info:
        PipelineLayout.from_model(chain((0, 0), (-1, 1)))
    assert rules(info) == {"P11"} and "negative stage or IPU on relu1" in str(info.value)


def test_every_model_problem_at_once():
    layout = PipelineLayout.from_model(chain((0, 0), (0, 1), (3, 2), (2, 2)))
    with pytest.raises(ValidationError) as info:
        layout.check(config(**PIPELINED))
    assert {"V8", "V5", "P10"} <= rules(info)


# -- against a config -----------------------------------------------------------------------------


def test_check_passes_a_matching_config():
    layout = PipelineLayout.from_model(chain((0, 0), (1, 1), (2, 2)))
    layout.check(config(ipus_per_replica=4, accumulation={"factor": 5},
                        pipeline={"enabled": True, "stages": 3}))
    layout.check(config(mode="inference", ipus_per_replica=4, batches_per_step=3,
                        pipeline={"enabled": True}))


@pytest.mark.parametrize("kw, rule", [
    ({"ipus_per_replica": 2, "accumulation": {"factor": 8}, "pipeline": {"enabled": True}}, "V24"),
    ({"ipus_per_replica": 4, "accumulation": {"factor": 4}, "pipeline": {"enabled": True}}, "V6"),
    ({"ipus_per_replica": 4, "batches_per_step": 4, "pipeline": {"enabled": True}}, "V7"),
    ({"ipus_per_replica": 4, "accumulation": {"factor": 8},
      "pipeline": {"enabled": True, "stages": 2}}, "K-layout-stages"),
])
def test_check_errors(kw, rule):
    layout = PipelineLayout.from_model(chain((0, 0), (1, 1), (2, 2)))
    with pytest.raises(ValidationError) as info:
        layout.check(config(**kw))
    assert rule in rules(info)


def test_check_uses_the_merged_depth():
    # stages 0 and 1 share IPU 0: PopART runs 3 stages in training, not 2×3−1 = 5
    layout = PipelineLayout.from_model(chain((0, 0), (1, 0), (2, 1)))
    layout.check(config(ipus_per_replica=2, accumulation={"factor": 3},
                        pipeline={"enabled": True}))


def test_check_reports_unannotated_models():
    layout = PipelineLayout.from_model(chain((None, None)))
    with pytest.raises(ValidationError) as info:
        layout.check(config(ipus_per_replica=2, accumulation={"factor": 8},
                            pipeline={"enabled": True}))
    assert rules(info) == {"V25", "K-layout-unstaged"}


def test_check_warns_about_ignored_annotations():
    layout = PipelineLayout.from_model(chain((0, 0), (1, 1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layout.check(config(ipus_per_replica=2))
    texts = [str(w.message) for w in caught]
    assert any("[V3]" in t for t in texts)


def test_allocation_table():
    layout = PipelineLayout.from_model(chain((0, 0), (0, 0), (1, 1), (2, 0)))
    assert layout.allocation() == [(0, 0, ["relu0", "relu1"]), (1, 1, ["relu2"]),
                                   (2, 0, ["relu3"])]
    table = layout.allocation_table()
    assert "Device allocation: 3 forward stages" in table
    assert "relu0 … relu1" in table


def test_a_weight_read_on_two_ipus_is_refused_when_pipelining():
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    w = b.addInitializedInputTensor(np.ones(2, np.float32))
    with pb.stage(0):
        t = b.aiOnnx.add([x, w])
    with pb.stage(1):
        b.aiOnnx.mul([t, w])
    layout = pb.layout()
    cfg = config(ipus_per_replica=2, accumulation={"factor": 4}, pipeline={"enabled": True})
    with pytest.raises(ValidationError, match="weight 'init_input' is used on IPUs \\[0, 1\\]"):
        layout.check(cfg)
    layout.check(config(ipus_per_replica=2))  # not pipelined: PopART copies it


def test_an_input_read_on_two_ipus_is_accepted_when_pipelining():
    """PopART streams it to the first IPU and copies it on (no rule against it)."""
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [2]))
    with pb.stage(0):
        t = b.aiOnnx.relu([x])
    with pb.stage(1):
        b.aiOnnx.add([t, x])
    pb.layout().check(config(ipus_per_replica=2, accumulation={"factor": 4},
                             pipeline={"enabled": True}))


def test_unreadable_models_are_refused_with_a_reason(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00 not a protobuf \xff")
    with pytest.raises(ValueError, match="is not an ONNX model"):
        PipelineLayout.from_model(bad)
    model = chain((0, 0))
    model.graph.node[1].attribute[0].CopyFrom(helper.make_attribute("__pipeline_stage", [0, 1]))
    with pytest.raises(ValueError, match="__pipeline_stage is a INTS attribute; PopART reads an "
                                         "INT"):
        PipelineLayout.from_model(model)


def test_a_gap_in_inferred_stages_names_the_ipus():
    layout = PipelineLayout.from_model(chain((None, 0), (None, 2)))
    with pytest.raises(ValidationError, match="the IPUs \\(the stages PopART infers\\) used are "
                                              "\\[0, 2\\]"):
        layout.check(config(**PIPELINED))


@pytest.mark.parametrize("opset", [-2**63, 2**40, 0])
def test_an_opset_beyond_any_schema_is_named_not_crashed_on(opset):
    """A staged model whose opset no ONNX schema has (negative, beyond a C int): the layout
    reads it, naming the operator at the model's opset, or refuses it with the kit's error."""
    nodes = [helper.make_node("Relu", ["x"], ["y"], __pipeline_stage=0, __ipu_number=0),
             helper.make_node("Relu", ["y"], ["z"], __pipeline_stage=1, __ipu_number=1)]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", opset)])
    try:
        layout = PipelineLayout.from_model(model)
    except pk.PopartKitError:
        return
    assert layout.forward_stages == 2 and layout.stage_ipu == {0: 0, 1: 1}
