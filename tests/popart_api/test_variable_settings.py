"""popart.VariableSettings: grouped weights. The group arithmetic against PopART's documented
rules (commgroup.hpp: Consecutive groups {0..k-1}, {k..2k-1} ...; Orthogonal groups {0, m, 2m
..}, {1, m+1 ..} ... with m = replicas / k; Ungrouped: each replica alone), PopART's checks,
the Builder's record of the grouping, and sessions whose grouped weights are trained each by
its own group's replicas, against numpy references of PopART's SGD and Adam."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import popart_kit.popart as popart
from popart_kit._runtime.xla import placement

pytestmark = pytest.mark.filterwarnings("ignore::popart_kit.PopartKitWarning")

CG, VRM = popart.CommGroupType, popart.VariableRetrievalMode


def settings(kind, size=0, mode=None):
    group = popart.CommGroup(getattr(CG, kind), size)
    return popart.VariableSettings(group, getattr(VRM, mode or "OnePerGroup"))


def documented_groups(kind, size, replicas):
    """commgroup.hpp's description of each CommGroupType, written out."""
    if kind == "All":
        return [list(range(replicas))]
    if kind == "Ungrouped":
        return [[r] for r in range(replicas)]
    if kind == "Consecutive":
        return [list(range(g * size, (g + 1) * size)) for g in range(replicas // size)]
    m = replicas // size
    return [[g + i * m for i in range(size)] for g in range(m)]


# -- the arithmetic -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,size", [("All", 0), ("Ungrouped", 0), ("Consecutive", 2),
                                       ("Consecutive", 4), ("Orthogonal", 2), ("Orthogonal", 4)])
@pytest.mark.parametrize("replicas", [4, 8])
def test_groups_follow_popart_s_documented_rules(kind, size, replicas):
    vs = settings(kind, size)
    expected = documented_groups(kind, size, replicas)
    assert vs.groups(replicas) == expected
    assert vs.getGroupCount(replicas) == len(expected)
    assert vs.getRealGroupSize(replicas) == len(expected[0])
    assert [vs.getGroupRepresentative(g) for g in range(len(expected))] == [
        members[0] for members in expected]
    grouping = vs.getReplicaGrouping(replicas)
    assert [grouping.getGroupAt(r) for r in range(replicas)] == [
        next(g for g, members in enumerate(expected) if r in members) for r in range(replicas)]
    assert [grouping.getReplicasAt(g) for g in range(len(expected))] == expected
    assert vs.numReplicasReturningVariable(replicas) == len(expected)
    all_replicas = settings(kind, size, "AllReplicas")
    assert all_replicas.numReplicasReturningVariable(replicas) == replicas
    assert vs.shapeOnHost([3, 5], replicas) == ([3, 5] if len(expected) == 1
                                                 else [len(expected), 3, 5])
    assert vs.shapeOnReplica(vs.shapeOnHost([3, 5], replicas), replicas, "w") == [3, 5]


def test_constructors_defaults_and_stride_form():
    vs = popart.VariableSettings()
    assert vs.getCommGroupType() == CG.All and vs.getRetrievalMode() == VRM.OnePerGroup
    assert popart.VariableSettings(VRM.AllReplicas).getRetrievalMode() == VRM.AllReplicas
    domain = popart.VariableSettings(popart.CommGroup(CG.Consecutive, 2)).getSharedVariableDomain()
    assert (domain.type, domain.replicaGroupSize) == (CG.Consecutive, 2)
    strided = popart.VariableSettings(2, 2, VRM.OnePerGroup)  # groups of 2, 2 apart
    assert not strided.isUsingCommGroup()
    assert strided.groups(8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert strided == popart.VariableSettings(stride=2, groupSize=2, mode=VRM.OnePerGroup)
    assert strided != settings("Consecutive", 2)


def test_popart_s_checks():
    with pytest.raises(popart.popart_exception, match="VariableSettings had 1 errors!"):
        settings("Consecutive", 0)
    with pytest.raises(popart.popart_exception, match="stride in a `popart::VariableSettings`"):
        popart.VariableSettings(0, 2, VRM.OnePerGroup)
    with pytest.raises(popart.popart_exception, match="not initialised using a `popart::Comm"):
        popart.VariableSettings(1, 2, VRM.OnePerGroup).getSharedVariableDomain()
    with pytest.raises(popart.popart_exception, match="must be divisible by the product"):
        settings("Consecutive", 3).getReplicaGrouping(4)
    with pytest.raises(popart.popart_exception, match=r"should match numGroups: 2"):
        settings("Ungrouped").shapeOnReplica([3, 5], 2, "w")
    with pytest.raises(TypeError, match="no constructor"):
        popart.VariableSettings("All")


def test_builder_records_the_grouping_as_popart_does():
    b = popart.Builder()
    w = b.addInitializedInputTensor(np.zeros((2, 3), np.float32), settings("Consecutive", 2,
                                                                          "AllReplicas"), "w")
    plain = b.addInitializedInputTensor(np.zeros(3, np.float32), "v")
    model = onnx.load_from_string(b.getModelProto())
    props = {p.key: p.value for p in model.metadata_props}
    assert props[f"__comm_group_type/{w}"] == "1"  # Consecutive
    assert props[f"__comm_group_size/{w}"] == "2"
    assert props[f"__variable_settings/{w}"] == "2"  # AllReplicas
    assert not any(k.endswith("/" + plain) for k in props if k.startswith("__comm"))
    assert b.getTensorShape(w) == [2, 3]  # the initializer holds every group's value
    again = popart.Builder(b.getModelProto())  # the record survives a round trip
    assert onnx.load_from_string(again.getModelProto()).metadata_props == model.metadata_props
    with pytest.raises(popart.popart_exception, match="not initialised using a `popart::Comm"):
        b.addInitializedInputTensor(np.zeros(3, np.float32),
                                    popart.VariableSettings(1, 2, VRM.OnePerGroup))


# -- sessions -----------------------------------------------------------------------------------

def session(replicas, vs, w_value, optimizer, reduction="Sum", strategy="Post"):
    """loss = sum((w * x)^2) per replica: dloss/dw = 2 w x^2, read at the replica's own w."""
    b = popart.Builder()
    w = (b.addInitializedInputTensor(w_value, vs, "w") if vs is not None
         else b.addInitializedInputTensor(w_value, "w"))
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    loss = b.aiOnnx.reducesumsquare([b.aiOnnx.mul([w, x])], keepdims=0)
    opts = popart.SessionOptions()
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = replicas > 1, replicas
    opts.accumulationAndReplicationReductionType = getattr(popart.ReductionType, reduction)
    opts.meanAccumulationAndReplicationReductionStrategy = getattr(
        popart.MeanReductionStrategy, strategy)
    flow = popart.DataFlow(1, {w: popart.AnchorReturnType("All")})
    s = popart.TrainingSession(fnModel=b.getModelProto(), loss=loss, optimizer=optimizer,
                               dataFlow=flow, userOptions=opts,
                               deviceInfo=popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    return s, w, x


def run(s, x, xs, steps=2):
    anchors = s.initAnchorArrays()
    for step in xs[:steps]:
        s.run(popart.PyStepIO({x: step}, anchors))
    return anchors


def read(s, w, shape):
    out = np.zeros(shape, np.float32)
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO({w: out}))
    return out


def group_grads(w_groups, x, members, divisor):
    """Each group's gradient: the sum over its own replicas, divided as the reduction says."""
    return np.stack([sum(2 * w_groups[g] * x[r] ** 2 for r in group) / divisor
                     for g, group in enumerate(members)])


SGD = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, False)})


@pytest.mark.parametrize("replicas,kind,size,reduction,strategy", [
    (2, "Ungrouped", 0, "Sum", "Post"),
    (4, "Consecutive", 2, "Mean", "Post"),
    (4, "Orthogonal", 2, "Mean", "Running"),
])
def test_sgd_moves_each_group_by_its_own_replicas_gradients(replicas, kind, size, reduction,
                                                            strategy):
    rng = np.random.default_rng(replicas + size)
    vs = settings(kind, size)
    members = vs.groups(replicas)
    w0 = rng.uniform(0.5, 1.5, (len(members), 3)).astype(np.float32)
    xs = rng.uniform(-1, 1, (2, replicas, 3)).astype(np.float32)
    s, w, x = session(replicas, vs, w0, SGD, reduction, strategy)
    anchors = run(s, x, xs)
    # PopART's divisor: none for Sum; the global replica count for Mean with Post; the group
    # size with Running (a Mean all-reduce inside the group)
    divisor = {"Sum": 1, "Post": replicas, "Running": len(members[0])}[
        "Sum" if reduction == "Sum" else strategy]
    ref, velocity = w0.astype(np.float64), np.zeros_like(w0, np.float64)
    for step in xs:  # SGD with momentum (Combined, no dampening or weight decay)
        velocity = 0.9 * velocity + group_grads(ref, step, members, divisor)
        ref = ref - 0.1 * velocity
    np.testing.assert_allclose(read(s, w, w0.shape), ref, rtol=1e-5)
    # the anchor: each replica's own value after the last step's update (PopART copies a
    # weight's anchor after its VarUpdate without gradient accumulation), its group's row
    group_of = [next(g for g, m in enumerate(members) if r in m) for r in range(replicas)]
    np.testing.assert_allclose(anchors[w], ref[group_of], rtol=1e-5)


def test_adam_on_ungrouped_replicas_with_mean_reduction():
    replicas, rng = 2, np.random.default_rng(7)
    vs = settings("Ungrouped")
    w0 = rng.uniform(0.5, 1.5, (2, 3)).astype(np.float32)
    xs = rng.uniform(-1, 1, (3, replicas, 3)).astype(np.float32)
    adam = popart.Adam({"defaultLearningRate": (0.05, False)}, mode=popart.AdamMode.Adam)
    s, w, x = session(replicas, vs, w0, adam, "Mean")
    run(s, x, xs, steps=3)
    ref, m, v = w0.astype(np.float64), 0.0, 0.0
    for t, step in enumerate(xs, start=1):  # PopART's Adam: b1 0.9, b2 0.999, eps 1e-6
        g = group_grads(ref, step, vs.groups(replicas), replicas)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        ref = ref - 0.05 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-6)
    np.testing.assert_allclose(read(s, w, w0.shape), ref, rtol=1e-5)
    # the optimizer state follows the grouping: one first moment per group
    accl1 = np.zeros((2, 3), np.float32)
    s.readWeights(popart.PyWeightsIO({"Accl1___" + w: accl1}))
    np.testing.assert_allclose(accl1, m, rtol=1e-5)


def test_all_grouping_is_a_plain_weight():
    rng = np.random.default_rng(3)
    w0 = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    xs = rng.uniform(-1, 1, (2, 2, 3)).astype(np.float32)
    got = []
    for vs in (settings("All"), None):
        s, w, x = session(2, vs, w0, SGD, "Mean")
        run(s, x, xs)
        got.append(read(s, w, w0.shape))
    np.testing.assert_array_equal(got[0], got[1])
    assert not np.allclose(got[0], w0)


def test_read_and_write_shapes_per_retrieval_mode():
    rng = np.random.default_rng(5)
    w0 = rng.uniform(0.5, 1.5, (2, 3)).astype(np.float32)  # Consecutive(2) of 4: 2 groups
    s, w, x = session(4, settings("Consecutive", 2, "AllReplicas"), w0, SGD)
    every = read(s, w, (4, 3))  # AllReplicas: one row per replica, its group's value
    np.testing.assert_array_equal(every, w0[[0, 0, 1, 1]])
    with pytest.raises(popart.popart_exception, match="has 6 elements"):
        s.writeWeights(popart.PyWeightsIO({w: w0}))
    new = rng.uniform(0.5, 1.5, (4, 3)).astype(np.float32)
    s.writeWeights(popart.PyWeightsIO({w: new}))
    s.weightsFromHost()
    np.testing.assert_array_equal(read(s, w, (4, 3)), new[[0, 0, 2, 2]])  # each group's first
    one, _, _ = session(4, settings("Consecutive", 2), w0, SGD)
    np.testing.assert_array_equal(read(one, w, (2, 3)), w0)  # OnePerGroup: one row per group


def test_replicas_over_several_devices(monkeypatch):
    monkeypatch.setattr(placement, "CPU_REPLICA_DEVICES", 2)  # 2 replicas on each of 2 devices
    rng = np.random.default_rng(11)
    vs = settings("Orthogonal", 2)
    w0 = rng.uniform(0.5, 1.5, (2, 3)).astype(np.float32)
    xs = rng.uniform(-1, 1, (2, 4, 3)).astype(np.float32)
    s, w, x = session(4, vs, w0, popart.SGD({"defaultLearningRate": (0.1, False)}))
    assert len(s._kit.runtime.placement.devices) == 2
    run(s, x, xs)
    ref = w0.astype(np.float64)
    for step in xs:
        ref = ref - 0.1 * group_grads(ref, step, vs.groups(4), 1)
    np.testing.assert_allclose(read(s, w, w0.shape), ref, rtol=1e-5)


def test_refusals_name_the_weight_and_the_grouping():
    w0 = np.ones((3, 3), np.float32)  # 3 values, but Ungrouped on 2 replicas makes 2 groups
    with pytest.raises(popart.popart_exception, match=r"Incorrect size of tensor w.*== "
                                                       r"group_size = 2"):
        session(2, settings("Ungrouped"), w0, SGD)
    with pytest.raises(popart.popart_exception, match=r"weight 'w'.*Consecutive, 4.*does not "
                                                       r"divide the session's 2 replicas"):
        session(2, settings("Consecutive", 4), np.ones((2, 3), np.float32), SGD)
    lamb = popart.Adam({"defaultLearningRate": (0.1, False)}, mode=popart.AdamMode.Lamb)
    with pytest.raises(popart.popart_exception, match=r"weight 'w' \(CommGroup\(Ungrouped, 0\)"
                                                       r".*LAMB"):
        session(2, settings("Ungrouped"), np.ones((2, 3), np.float32), lamb)


def test_inference_replicas_compute_with_their_group_s_value():
    b = popart.Builder()
    w0 = np.arange(6, dtype=np.float32).reshape(2, 3) + 1  # Orthogonal(2) of 4: 2 groups
    w = b.addInitializedInputTensor(w0, settings("Orthogonal", 2), "w")
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    y = b.aiOnnx.mul([w, x])
    opts = popart.SessionOptions()
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 4
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                popart.DeviceManager().createCpuDevice(), userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    xs = np.random.default_rng(2).uniform(-1, 1, (4, 3)).astype(np.float32)
    s.run(popart.PyStepIO({x: xs}, anchors))
    np.testing.assert_allclose(anchors[y], w0[[0, 1, 0, 1]] * xs, rtol=1e-6)
