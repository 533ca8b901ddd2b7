"""The rule registry: every rule id the kit reports, what it checks and the PopART behaviour it
mirrors. ``docs/rules.md`` is generated from it (:func:`markdown`; a test keeps them in step)."""

from __future__ import annotations

__all__ = ["RULES", "POPART_RUNS", "markdown"]

_KIT = "kit rule: PopART accepts this or fails later"
_FILE = "kit rule: config files are the kit's (PopART has none)"

# id: (what it checks, the PopART behaviour it mirrors)
RULES: dict[str, tuple[str, str]] = {
    # -- PopART's own checks (willow sources), reported before anything compiles -------------------
    "V1": ("Pipelining needs more than one IPU per replica and a virtual graph mode that is "
           "not off.",
           "ir.cpp verifyPipelineSettings: 'Pipelining requires more than 1 IPU'."),
    "V2": ("Pipelining with virtual_graph_mode off.",
           "transforms/pipeline.cpp: 'Pipelining requires the virtualGraphMode ... not Off'."),
    "V3": ("Pipeline-stage annotations on a model whose session does not pipeline (warning).",
           "ir.cpp verifyPipelineSettings silently clears the annotations."),
    "V4": ("With pipelining, every op has a pipeline stage, or none does.",
           "ir.cpp: 'Only some ops have had their pipeline stage set'."),
    "V5": ("When pipelining, the ops of one pipeline stage sit on one IPU (virtual graph).",
           "ir.cpp: 'Ops ... have the same pipeline stage ..., but different virtual graph ids'."),
    "V6": ("With accumulation, accumulation.factor is at least the pipeline depth (under "
           "popart_kit.popart also when enableGradientAccumulation is set with factor 1).",
           "transforms/pipeline.cpp:1389: 'depth (gradient accumulation factor) must equal "
           "at least the number of pipeline stages'."),
    "V7": ("Without accumulation, batches_per_step is at least the pipeline depth.",
           "pipeline.cpp: 'depth (batchesPerStep) must equal at least the number of pipeline "
           "stages'."),
    "V8": ("When pipelining, pipeline stages are numbered without gaps.",
           "ir.cpp getNumPipelineStages: 'stage k is missing'."),
    "V11": ("Explicit pipelining needs explicitRecomputation, useHostCopyOps and "
            "enableExplicitMainLoops.",
            "ExplicitPipelineHelper::compatibilityChecks: 'SessionOption ... must be true'."),
    "V12": ("enableExplicitMainLoops needs useHostCopyOps.",
            "ir.cpp verifyExplicitMainLoopsSettings."),
    "V13": ("No EveryN anchor with explicit main loops.",
            "transforms/mainloops.cpp: 'EveryN ... is unsupported'."),
    "V14": ("No EveryN anchor in a pipelined session.",
            "irlowering.cpp: 'AnchorReturnType::EVERYN is not valid for pipelined models'."),
    "V17": ("aliasZeroCopy needs explicit pipelining and recomputation.",
            "ir.cpp verifyAliasZeroCopySettings."),
    "V18": ("Gradient accumulation only in training sessions.",
            "ir.cpp prepareImpl: 'Gradient Accumulation only available when training'."),
    "V19": ("accumulationFactor > 1 needs enableGradientAccumulation (set together by "
            "accumulation.factor).", "sessionoptions.cpp getAccumulationFactor."),
    "V21": ("replicatedGraphCount > 1 needs enableReplicatedGraphs (set together by "
            "replication.local_factor).", "irlowering.cpp getReplicationFactor."),
    "V22": ("The device's IPUs divide evenly among the replicas.",
            "ir.cpp getNumVirtualGraphIds: 'the number of IPUs must be divisible by the "
            "replication factor'."),
    "V23": ("With virtual graphs off, one IPU per replica.",
            "irlowering.cpp prepareGraph: 'replicated graph count needs to be equal to the number "
            "of IPUs'."),
    "V24": ("Every op's virtual graph id is below ipus_per_replica.",
            "irlowering.cpp: 'has been assigned to an invalid virtual graph'."),
    "V25": ("virtual_graph_mode manual needs annotated ops.",
            "ir.cpp verifyVirtualGraphIds: 'no Ops have been annotated'."),
    "V26": ("With virtual graphs on (virtual_graph_mode not off), every op has a virtual graph "
            "id, or none does.",
            "ir.cpp: 'Either all Ops must have their virtual graph ids set, or none must'."),
    "V27": ("Virtual graph annotations with virtual_graph_mode off (warning).",
            "ir.cpp unsetAllVirtualGraphIds drops them with an info log."),
    "V28": ("virtualGraphSplitRatios: one per IPU, each in (0, 1), summing to 1.",
            "transforms/auto_virtual_graph.cpp."),
    "V29": ("More than one execution phase needs virtual_graph_mode execution_phases.",
            "ir.cpp verifyExecutionPhaseSettings."),
    "V30": ("Execution phases enabled with fewer than two phases (warning).",
            "ir.cpp verifyExecutionPhaseSettings: 'Phased execution ... Disabling.'"),
    "V38": ("Loop batch serialisation in training needs transformContext Bwd.",
            "ir.cpp verifyBatchSerializationSettings."),
    "V40": ("numIOTiles with virtual graphs: even, at least 32, fewer than the tiles per IPU.",
            "irlowering.cpp: 'invalid number of IO tiles'."),
    "V41": ("gclOptions keys are useSynclessCollectives and maxBytesPerTile.",
            "irlowering.cpp: 'is not a valid gcl option'."),
    "V42": ("opxModifyChecking with replicated graphs.",
            "irlowering.cpp: 'Can not do opx modify checking when using replicated graphs'."),
    "V43": ("Buffering depths are at least 1.",
            "sessionoptions.cpp: 'Unable to support a buffering depth of ...'."),
    "V44": ("createImplicitPipeliningFwdOnlyProgram needs implicit pipelining and "
            "accumulation.", "ir.cpp (deprecated option)."),
    "V46": ("An EveryN anchor's period is positive and divides batches_per_step.",
            "dataflow.cpp: 'Return period must be a factor of ...'."),
    "V49": ("virtual_graph_mode auto finds a split point per IPU.",
            "PopART's AutoVirtualGraph transform (auto_virtual_graph.cpp: \"Couldn't find enough "
            "splits\")."),
    "V50": ("virtual_graph_mode execution_phases: each op's phase below "
            "executionPhaseSettings.phases and its IPU equal to its phase modulo the stages.",
            "PopART's StreamingMemory transform (streamingmemory.cpp: \"Maximum phase is\", "
            "streamingmemoryopinserter.cpp: \"inconsistent execution phase\")."),
    "V51": ("Reduction axes lie in [-rank, rank - 1] (ai.onnx Reduce* and ai.graphcore "
            "ReduceMedian; ONNX's text says so too).",
            "util.cpp:359 validateReduceAxis (from ReduceOp::setup, op/reduce.cpp:47): "
            "'Axis ... is out of acceptable range'."),
    "V52": ("Sum, Mean, Max and Min of opset 6 take inputs of one type and shape (ONNX's "
            "version 6 does not broadcast).",
            "op/variadic.cpp:35 VariadicOp::setup: 'Inputs to ... do not all the same type & "
            "shape'."),
    "V53": ("ai.graphcore Reverse dimensions are non-negative, below the input's rank and "
            "given once.", "op/reverse.cpp:38, :45, :54 ReverseBaseOp::setup."),
    "V54": ("Clip-11's min and max are constants (initializers or Constants). Only under "
            "popart_kit.popart: the xla backend runs a computed min or max.",
            "op/clip.cpp:155, :166: 'currently only supports constant min/max parameters'."),
    "V55": ("MaxPool-10 dilations are 1. Only under popart_kit.popart: the xla backend runs "
            "dilated pooling.", "op/maxpool.cpp:202: 'Dilations of value other than 1 are "
            "currently not supported'."),
    "V56": ("AveragePool's count_include_pad is 0. Only under popart_kit.popart: the xla "
            "backend runs it.", "op/averagepool.cpp:46: '`count_include_pad` is not "
            "supported'."),
    "V57": ("excludePatterns names patterns PopART has. Only under popart_kit.popart (the "
            "annotation changes nothing on the xla backend).",
            "op.cpp:842: 'Invalid pattern name ... in Op::excludePatterns'."),
    "V58": ("setSerializeMatMul's factor is non-zero and divides the dimension its mode "
            "splits. Only under popart_kit.popart.",
            "op/matmul.cpp:241, :258, :271, :283 MatMulOp::setup: 'Invalid serialisation "
            "factor'."),
    "V59": ("A gradient anchor names a tensor the loss depends on through differentiable ops "
            "(not through Detach). Only under popart_kit.popart.",
            "ir.cpp:2497 Ir::validateAnchors: 'Anchor tensor ... not in Ir Tensors'."),
    "V60": ("Manual recomputation (recomputeOutputInBackwardPass) is not mixed with "
            "autoRecomputation. Only under popart_kit.popart.",
            "ir.cpp:1420: 'A mixture of auto and manual recomputation is not supported'."),
    "V61": ("Some operation is needed by an anchor, the loss or a side effect. Only under "
            "popart_kit.popart.", "transforms/prune.cpp:397: 'All operations in the main "
            "graph were pruned, nothing to compute'."),
    "V62": ("An op PopART has no Opx for (Cosh, ConvTranspose, and the gradients of Cos, "
            "Sqrt, Exp, Expm1, Log1p, Reciprocal, Abs, Atan2, Sub's second input, MatMul and "
            "Conv) is removed by its pattern: with runtime asserts off a disabled pattern "
            "leaves it. Only under popart_kit.popart (the patterns change nothing here).",
            "popx/irlowering.cpp:675 IrLowering::createOpx: 'This op should have been "
            "removed by pattern ...'."),
    "V64": ("When pipelining, every op of a subgraph that aiGraphcore.call calls has the "
            "calling op's virtual graph id. Only under popart_kit.popart.",
            "op/call.cpp:323-345 (the Call op's creator): 'subgraph ops must have a virtual "
            "graph id matching the calling op'."),
    "V63": ("resetHostWeights is refused for an inference session with constantWeights. Only "
            "under popart_kit.popart.", "session.cpp:787 Session::resetHostWeights."),
    "V65": ("An inference session anchors at least one tensor. Only under popart_kit.popart.",
            "ir.cpp:416 Ir::setDataFlow: 'User must specify an anchor tensor when doing "
            "inference.'"),
    "V66": ("A Constant has no sparse_value. Only under popart_kit.popart.",
            "onnxpasses/nodepatterns/constfoldops.cpp:98: 'The Constant op attribute "
            "'sparse_value' is not supported.'"),
    "V67": ("On an IPU Model device, every virtual graph id is below the device's IPUs per "
            "replica (a CPU device stretches to what the model uses); checked by "
            "prepareDevice. Only under popart_kit.popart.",
            "popx/irlowering.cpp:2979: '... has been assigned to an invalid virtual graph "
            "...'."),
    # -- configuration ----------------------------------------------------------------------------
    "K-unknown-key": ("A key or keyword a config section, optimizer or session does not have "
                      "(suggests the closest field or PopART option).",
                      "PopART's pybind options raise AttributeError, one at a time."),
    "K-count-range": ("Counts fit PopART's 32-bit ints.", _KIT),
    "K-max-ipus": ("At most 64 IPUs per instance.", _KIT),
    "K-max-global-ipus": ("At most 64,000 IPUs over all instances.", _KIT),
    "K-power-of-two": ("IPU requests are powers of two on IPU hardware.",
                       "DeviceManager finds no device for other counts."),
    "K-replication-global-below-local": ("global_factor >= local_factor.",
                                         "ir.cpp verifyDistributedReplicatedGraphSettings."),
    "K-replication-global-multiple": ("global_factor is a multiple of local_factor.",
                                      _KIT + " (PopART does not check it)."),
    "K-replication-offset-multiple": ("global_offset is a multiple of local_factor.",
                                      _KIT + " (PopART does not check it)."),
    "K-replication-offset-range": ("global_offset + local_factor <= global_factor.",
                                   "ir.cpp checks only offset <= factor."),
    "K-replication-offset-without-global": ("global_offset needs global_factor.", _KIT),
    "K-replication-target": ("Replication needs an IPU or offline target.",
                             "irlowering.cpp initPoplarGraph (distributed case)."),
    "K-cpu-one-ipu": ("The cpu target has one IPU.", "DeviceManager.createCpuDevice."),
    "K-sync-pattern-host": ("Sync patterns only on IPU hardware.", _KIT),
    "K-rounding-target": ("round_to_power_of_two only on IPU hardware (warning).", _KIT),
    "K-connection-never": ("connection 'never' cannot run, only compile.", _KIT),
    "K-offline-run": ("An offline device compiles only; running needs another target.",
                      "PopART: 'Cannot run on an offline device'."),
    "K-caching-target": ("Engine caching on a host target has no effect (warning).", _KIT),
    "K-bubble": ("Pipeline bubble above 30% (warning).", _KIT),
    "K-stale-weights": ("Pipelined training with batches_per_step > 1 and no accumulation "
                        "updates weights between micro-batches in flight (warning).", _KIT),
    "K-recompute-inference": ("Recomputation only in training.", _KIT),
    "K-recompute-pipeline": ("Pipeline recomputation needs pipelining (warning).", _KIT),
    "K-mean-strategy": ("accumulation.mean_strategy given with reduction='sum', where it does "
                        "nothing (warning).", _KIT),
    "K-partials-conflict": ("precision.partials_type and the popart_options partials agree.",
                            _KIT),
    "K-option-controlled": ("A popart_options name a typed field controls.", _KIT),
    "K-option-elsewhere": ("A name that is not a SessionOptions attribute but set elsewhere.",
                           _KIT),
    "K-option-unknown": ("A popart_options name SessionOptions does not have.",
                         "pybind AttributeError."),
    "K-option-type": ("A popart_options value of the wrong type.", "pybind TypeError."),
    "K-option-deprecated": ("A deprecated option (warning).", "PopART logs a deprecation."),
    "K-popdist-env": ("POPDIST_* variables poprun sets are consistent.", "popdist."),
    "K-file-format": ("A config file's suffix is .toml, .yaml, .yml or .json.", _FILE),
    "K-file-missing": ("The config file exists.", _FILE),
    "K-file-unreadable": ("The config file can be read.", _FILE),
    "K-file-encoding": ("The config file is UTF-8.", _FILE),
    "K-file-size": ("The config file is of a config's size.", _FILE),
    "K-file-syntax": ("The config file parses.", _FILE),
    "K-file-duplicate-key": ("No key twice in a config file.", _FILE),
    "K-file-depth": ("Nesting no deeper than a config needs; YAML aliases bounded.", _FILE),
    "K-file-top-level": ("The top level of a config file is a table.", _FILE),
    "K-cli-instance": ("popart-kit plan --instance names an existing instance.", _KIT),
    "K-launch-program": ("A launcher (poprun, srun, a pod) starts one program: no ';', '&&', "
                         "'|' in it (setup goes before it), and not none.",
                         "poprun would launch the first word."),
    "K-launch-poprun-args": ("Extra poprun arguments do not set what the config decides.",
                             "poprun's --num-replicas, ... must match the session."),
    "K-launch-k8s": ("IPUJob names are DNS-1123 labels, Indexed Job names DNS-1035 labels "
                     "short enough for the pods' host names; image, CPU, memory, port and "
                     "secret well formed.", "kubectl refuses the resource."),
    "K-launch-slurm": ("A SLURM job's name is plain, its nodes split the instances evenly, its "
                       "CPUs per task, time limit and port well formed.",
                       "sbatch refuses the script, or srun starts uneven instances."),
    "K-report-missing": ("popart-kit report DIR needs a report an xla session wrote.", _KIT),
    "K-bench-sweep": ("A bench sweep's lists are distinct positive integers, its variants valid "
                      "sessions (else refused before anything runs, or --skip-invalid).", _KIT),
    "K-bench-model": ("A bench model is a built-in one (mlp, convnet, encoder) with at least as "
                      "many layers as stages, or an ONNX file with a streamed input and an "
                      "output (and a loss to train).", _KIT),
    "K-bench-spec": ("A bench spec is a YAML or TOML file with a 'benchmarks' table of named "
                     "parameter tables.", _KIT),
    "K-bench-results": ("--plot and --compare read results.json files written by popart-kit "
                        "bench; compared results share variant names.", _KIT),
    "K-bench-instances": ("Every instance of a multi-instance bench variant reports its "
                          "numbers.", _KIT),
    # -- optimizers -------------------------------------------------------------------------------
    "K-optimizer-arguments": ("learning_rate given once.", _KIT),
    "K-optimizer-hyper": ("Hyperparameters match the compiled optimizer's.", _KIT),
    "K-optimizer-trees": ("One gradient per weight.", _KIT),
    "K-optimizer-state": ("The optimizer state can be read on this backend.", _KIT),
    "K-sgd-lr": ("SGD learning rate is positive and finite.", "sgd.hpp."),
    "K-sgd-finite": ("SGD values are finite in float32.", _KIT),
    "K-sgd-momentum": ("SGD momentum in [0, 1).", "sgd.hpp."),
    "K-sgd-dampening": ("SGD dampening in [0, 1].", "sgd.hpp."),
    "K-sgd-nesterov-momentum": ("Nesterov needs momentum.", "torch/PopART SGD."),
    "K-sgd-nesterov-dampening": ("Nesterov needs zero dampening.", "torch/PopART SGD."),
    "K-sgd-velocity-scaling": ("SGD velocity scaling positive.", "sgd.hpp."),
    "K-sgd-weight-decay": ("SGD weight decay non-negative.", "sgd.hpp."),
    "K-sgd-loss-scaling": ("SGD loss scaling positive.", "sgd.hpp."),
    "K-adam-lr": ("Adam learning rate positive and finite.", "adam.hpp."),
    "K-adam-finite": ("Adam values are finite in float32.", _KIT),
    "K-adam-beta1": ("Adam beta1 in [0, 1).", "adam.hpp."),
    "K-adam-beta2": ("Adam beta2 in [0, 1).", "adam.hpp."),
    "K-adam-eps": ("Adam epsilon positive.", "adam.hpp."),
    "K-adam-weight-decay": ("Adam weight decay non-negative.", "adam.hpp."),
    "K-adam-loss-scaling": ("Adam loss scaling positive.", "adam.hpp."),
    "K-adam-max-weight-norm": ("Lamb max weight norm non-negative.", "adam.hpp."),
    # -- sessions ---------------------------------------------------------------------------------
    "K-session-type": ("Session arguments of the right types.", _KIT),
    "K-session-closed": ("A session is not used after close().", _KIT),
    "K-session-mode": ("InferenceSession takes inference configs, TrainingSession training.",
                       _KIT),
    "K-session-anchors": ("An inference session has an anchor.",
                          "PopART: 'User must specify an anchor tensor when doing inference'."),
    "K-session-optimizer": ("set_optimizer keeps the optimizer's kind.",
                            "updateOptimizerFromHost refuses another kind."),
    "K-micro-batch-size": ("micro_batch_size equals the streamed inputs' leading dimension.",
                           _KIT + ": PopART's micro-batch is the input's shape."),
    "K-loss-unknown": ("The loss names a tensor of the model.", "PopART: no such tensor."),
    "K-loss-scalar": ("The loss has one element (a scalar, or a shape such as [1, 1]).",
                      "ir.cpp Ir::setFinalLoss: 'Loss tensor ... must be a scalar tensor' "
                      "when it has more than one element."),
    "K-anchor-unknown": ("Anchors name tensors of the model.", "PopART: no such tensor."),
    "K-no-weights": ("A training model has weights to train.", _KIT),
    "K-constant-weights": ("Weights marked constant are not trained.", _KIT),
    "K-gradient-constant": ("No gradient anchor for a constant.", _KIT),
    "K-gradient-dtype": ("Gradient anchors of float tensors.", _KIT),
    "K-weight-unknown": ("write_weights names weights of the model.", "PopART: no such weight."),
    "K-weight-shape": ("write_weights arrays have the weights' shapes.", "PopART."),
    "K-variable-settings": ("A grouped weight (VariableSettings) has one value per group of "
                            "the session's replicas, its grouping divides them, and it is not "
                            "pipelined, over several instances, trained by LAMB or clipped.",
                            "PopART's addVarInit and ReplicaGrouping checks; the rest the xla "
                            "backend cannot run."),
    "K-nonfinite-update": ("A training run met NaN/Inf: nothing is applied.", _KIT),
    "K-memory": ("The step fits the device's memory.", "Poplar: out of memory."),
    "K-pipeline-workers": ("pipeline_workers is 'threads' or 'processes'; processes run the "
                           "stages in CPU worker processes, not on GPUs.", _KIT),
    "K-stage-worker": ("A stage's worker process that fails, dies or falls silent stops the "
                       "run with its stage named; nothing is applied.", _KIT),
    "K-chunk": ("micro_batches_per_chunk is a positive count (the chunk used is the largest "
                "that divides an update's micro-batches and lines up with every EveryN "
                "period).", _KIT),
    "K-popdist-conflict": ("A config value set away from its default agrees with the POPDIST_* "
                           "environment poprun (or popart-kit launch) gives the instance.",
                           "PopART's popdist backend takes the environment and overrides the "
                           "session options without a word."),
    "K-xla-distributed-env": ("This process's place among the instances (OMPI_* or POPDIST_* "
                              "variables, the coordinator) is complete and agrees with the "
                              "config.", "poprun sets the same variables for PopART; MPI fails "
                              "late when they disagree."),
    "K-instance-failed": ("A run stops with an error naming the instance that died or never "
                          "arrived, within the fault timeout.",
                          "PopART under poprun: MPI aborts the job."),
    "K-cluster-env": ("The launchers' variables (POPDIST_*, Open MPI, PMIx, SLURM, torchrun, "
                      "a Kubernetes Indexed Job, JAX) agree on the process count, index and "
                      "coordinator, and a process a launcher counts as one of several does not "
                      "run as a lone job.", "kit rule: poprun's popdist reads POPDIST_* only"),
    "K-launch": ("popart-kit launch gets consistent counts, an existing program and a free "
                 "coordinator port, before anything starts.",
                 "poprun: its own checks of --num-instances/--num-replicas."),
    "K-xla-recompute": ("pipeline.recomputation is one the xla backend can honour: standard, "
                        "recompute_all and pipeline recompute a stage's forward in its "
                        "backward; norm_only is refused.",
                        "PopART's RecomputationType: which activations are recomputed rather "
                        "than stashed."),
    "K-xla-stochastic-rounding": ("precision.stochastic_rounding has no meaning on the xla "
                                  "backend (a warning): XLA rounds to nearest.",
                                  "IPUs round half-precision results stochastically when "
                                  "enableStochasticRounding is set."),
    "K-placement": ("Replicas fit the available devices.", _KIT),
    # -- host data --------------------------------------------------------------------------------
    "K-stepio-type": ("Inputs are a mapping of names to numpy arrays.", "PyStepIO."),
    "K-stepio-missing": ("Every input of the model is given.", "PyStepIO: missing input."),
    "K-stepio-unknown": ("No array for a tensor the model does not stream.", _KIT),
    "K-stepio-shape": ("Arrays have the [bps, A, R, *S] shape.", "PyStepIO shape checks."),
    "K-stepio-size": ("Samples make whole micro-batches.", _KIT),
    "K-stepio-sample": ("Samples have the tensor's trailing axes.", _KIT),
    "K-stepio-dtype": ("Arrays have the tensor's dtype.", "PyStepIO dtype check."),
    "K-stepio-cast": ("A cast does not change values.", _KIT),
    "K-stepio-contiguous": ("Arrays are C-contiguous.", "PyStepIO requires it."),
    "K-stepio-readonly": ("Anchor arrays are writable.", "PyStepIO writes into them."),
    "K-stepio-spec": ("TensorSpecs are well formed.", _KIT),
    "K-stepio-no-batch-axis": ("Sharding needs a batch axis.", _KIT),
    "K-stepio-broadcast-batches": ("Broadcast inputs have no per-batch axis.", _KIT),
    "K-index-range": ("Index inputs (labels, Gather indices) within the size they index.",
                      "PopART/XLA read out of range silently."),
    "K-int64-range": ("INT64 (UINT64) values of inputs and weights fit INT32 (UINT32).",
                      "PopART computes INT64 as INT32."),
    "K-double": ("No float64 data.", "PopART has no float64 on the IPU."),
    # -- models -----------------------------------------------------------------------------------
    "K-model-type": ("A model is a ModelProto, bytes or a path.", _KIT),
    "K-model-file": ("The model file is a regular file of at most 2 GiB (protobuf's limit), "
                     "checked before reading, and can be read.", _KIT),
    "K-model-opset": ("Imported opset versions are at least 1 and fit 32 bits.", "onnx."),
    "K-model-external-data": ("External data is read only for a model given by its path, from "
                              "its folder; a model given as bytes or a ModelProto has none.",
                              "kit rule: onnx resolves it against the working directory"),
    "K-file-write": ("A file the kit writes (config, model, checkpoint, report, results) is "
                     "replaced whole or not at all; a failed write leaves the old file.",
                     "kit rule: PopART writes its files in place"),
    "K-model-decode": ("The bytes are an ONNX model.", "onnx."),
    "K-model-onnx-checker": ("The model passes onnx.checker's structural check.",
                             "PopART runs the same check (builder_impl.cpp, "
                             "graphtransformer_impl.cpp: checker::check_model)."),
    "K-model-onnx-inference": ("The model passes ONNX's strict shape and type inference (types "
                               "each operator's schema lists, consistent shapes).",
                               "PopART infers leniently (InferShapes, builder_impl.cpp "
                               "runShapeInference) and its ops take more types (UINT32 "
                               "indices)."),
    "K-model-popart-setup": ("Each op's inputs are ones PopART's op takes (shapes that "
                             "broadcast, one data type where it wants one, constant shape "
                             "inputs), in its words.",
                             "PopART's op setup() (willow/src/op/*.cpp), when a session is "
                             "made."),
    "K-model-cycle": ("The graph has no cycle.", "onnx."),
    "K-model-undefined-input": ("Every node input is defined.", "onnx."),
    "K-model-duplicate-input": ("No graph input twice.", "onnx."),
    "K-model-duplicate-initializer": ("No initializer twice.", "onnx."),
    "K-model-duplicate-producer": ("One producer per tensor.", "onnx."),
    "K-model-attribute-type": ("Attributes of the schema's types.", "onnx."),
    "K-model-attribute-unknown": ("Attributes the schema has.", "onnx."),
    "P9": ("When pipelining a model without stage annotations, data flows to the same or a "
           "later IPU (PopART takes each op's IPU as its stage).", "PopART's pipeline "
           "transform: a consumer on an earlier stage than its producer is an error; without "
           "pipelining ir.cpp verifyPipelineSettings clears the stages and data may flow back."),
    "P10": ("When pipelining, data flows to the same or a later pipeline stage.",
            "PopART's pipeline transform: a consumer on an earlier stage than its producer is "
            "an error (without pipelining the stages are cleared)."),
    "P11": ("Stages and IPUs are numbered from 0.", "PopART: 'Op has bad pipeline stage'."),
    "P20": ("When pipelining, every op reading a weight sits on one IPU.",
            "PopART: 'Can not copy variable tensor ... between virtual graphs when "
            "pipelining'."),
    "P-attribute-type": ("__pipeline_stage and __ipu_number are INT attributes.",
                         "PopART reads them as integers."),
    "K-layout-stages": ("Pipeline stage count in the model and the config agree.", _KIT),
    "K-layout-unstaged": ("A pipelined model has stage annotations.", "V4."),
    "K-one-stage": ("Pipelining a one-stage model (warning).", _KIT),
    "K-static-shape": ("Graph inputs have static shapes (no dim_param, no negative or missing "
                       "size).", "PopART refuses them unless InputShapeInfo gives the shape "
                       "(ir.cpp checkForDimParams), in the same words."),
    "K-xla-unsupported": ("Operators the xla backend lowers.", "xla backend."),
    "K-xla-node-failed": ("A node the xla backend could not compute.", "xla backend."),
    "K-xla-dropout": ("Random operators on xla (Dropout and ShapedDropout in a training "
                      "session, RandomNormal/RandomUniform(Like) in any) draw from the "
                      "session's seed (set_random_seed; until set, one from the clock): the "
                      "same seed repeats the runs, and each micro-batch, step and replica "
                      "draws its own values; Dropout keeps 1 - ratio of the elements, scales "
                      "them by 1/(1 - ratio) and masks its gradient alike. The generator is "
                      "JAX's threefry, not Poplar's: same distributions, not the same numbers "
                      "as an IPU for the same seed.",
                      "Session::setRandomSeed; the seed offset per replica and moved on per "
                      "step (irlowering.cpp initRandomSeed, GetRandomSeedOp); Dropout is the "
                      "identity in an InferenceSession (dropoutx.cpp); a seed attribute is "
                      "refused (randombase.cpp)."),
    "K-xla-auto-loss-scaling": ("Automatic loss scaling as PopART checks it: a training "
                                "session whose optimizer's loss scaling is not const, "
                                "pipelining only with gradient accumulation, fp16 gradients "
                                "to track (or toTrackTensors, with "
                                "GradientsOfUserSpecifiedTensors, naming tensors of the model), "
                                "binEdgeLocation and thresholdUpperCountProportion in [0, 1], "
                                "updatePeriod >= 1.", "transforms/automaticlossscaling.cpp "
                                "(AutomaticLossScale::apply, getToTrackTensors, getLevels), "
                                "transforms/preautomaticlossscaling.cpp, "
                                "popx/op/lossscaleupdatex.cpp (the threshold)."),
    "K-xla-distributed": ("One xla process runs one instance.", "xla backend."),
    "K-xla-only": ("A feature only the xla backend has.", "xla backend."),
}


#: Kit rules stricter than PopART: PopART runs what they refuse. A PopART program (run through
#: ``popart_kit.popart``) gets a warning for them instead of an error; a ``pk`` session the
#: error.
POPART_RUNS = frozenset({"K-no-weights", "K-model-onnx-inference"})


def markdown() -> str:
    """The rules reference, ``docs/rules.md``."""
    lines = ["# Rules reference", "",
             "Every rule id popart_kit reports, what it checks, and the PopART behaviour it "
             "mirrors. `V<n>` rules are checks PopART itself makes (late: when it builds the IR "
             "or lowers it), `P<n>` rules the pipeline layout rules PopART enforces on a "
             "model's stage and IPU annotations; `K-...` rules are popart_kit's own. Errors "
             "and warnings end with `(see docs/rules.md#<id>)`. Generated from "
             "`popart_kit/_base/rule_docs.py` "
             "(`python -m popart_kit._base.rule_docs > docs/rules.md`). A PopART program run "
             "through `popart_kit.popart` meets PopART's refusals only: the kit rules marked "
             "*warning under popart_kit.popart* refuse what PopART runs, and only warn there.",
             "",
             "| id | checks | PopART |", "|---|---|---|"]
    for rule, (checks, popart) in RULES.items():
        if rule in POPART_RUNS:
            checks += " *Warning under popart_kit.popart: PopART runs it.*"
        lines.append(f'| <a id="{rule}"></a>`{rule}` | {checks} | {popart} |')
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
