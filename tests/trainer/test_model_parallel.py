"""Model parallelism in fit(): tensor parallel (tensorParallel, parallelizePlan), pipeline parallel
(pipelineParallel, pipelineSplit, pipelineSchedule, microbatches) and both, with ddp or fsdp across
the groups; device_mesh(tp=...) in run(): the weights of a one-rank fit, each rank holding its part,
checkpoints that resume at another layout, activation checkpointing, and the refusals made before
any Spark job. Real Spark, real
Parquet, real processes."""
import est_helpers as H
import parallel_fns as P
import pytest
import torch

from sparkring import ConfigurationError, SparkRingEstimator, Store, run

pytestmark = pytest.mark.slow  # real fits (module-scoped reference fits included)

PLAN = dict(parallelizePlan=P.MLP_PLAN)


def _fit(df, store, **kw):
    # keepData: every fit of a test reads the one prepared copy (a fit that does not keep it deletes
    # it, and a cluster's next preparation may order the rows otherwise)
    params = dict(model=P.mlp(width=64), optimizer=P.adam, loss="cross_entropy", batchSize=16, epochs=2,
                  store=store, verbose=0, seed=3, keepData=True)
    params.update(kw)
    return SparkRingEstimator(**params).fit(df)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.getModel().state_dict().items()}


def _same_weights(a, b, atol=1e-4):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=atol, rtol=0)


def _spans(trace, rank):
    import json

    return [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]


def _names(trace, rank):
    return {e["name"] for e in _spans(trace, rank)}


@pytest.fixture(scope="module")
def one_rank_reference(_spark_sessions, tmp_path_factory):
    """One rank, the whole model: what a tensor-parallel group of any size must train (its ranks
    read the same rows, so the group is one data-parallel replica)."""
    store = Store(str(tmp_path_factory.mktemp("tp-ref")))
    df = H.classification_df(_spark_sessions.get("local"), n=192)
    return df, store, _fit(df, store, numProc=1, runId="whole")


def test_tensor_parallel_fit_on_two_ranks_trains_the_weights_of_one_rank_holding_half_each(one_rank_reference,
                                                                                           tmp_path):
    df, store, whole = one_rank_reference
    split = _fit(df, store, numProc=2, tensorParallel=2, parallelizePlan=P.MLP_PLAN, runId="tp2",
                 activationCheckpointing="full", timeline=str(tmp_path / "tp2.json"))
    _same_weights(whole, split)  # the timeline waits for each collective: the same numbers
    # every rank's timeline holds its tensor-parallel collectives, with their bytes
    for rank in (0, 1):
        spans = _spans(tmp_path / "tp2.json", rank)
        reduces = [e for e in spans if e["name"] == "DTensor all_reduce"]
        assert reduces and all(e["tid"] == 1 and e["args"]["bytes"] > 0 for e in reduces)
    assert [h["loss"] for h in split.history] == pytest.approx([h["loss"] for h in whole.history], abs=1e-4)
    full = sum(p.numel() for p in P.mlp(width=64)().parameters())
    halved = 8 * 64 + 64 + 64 * 64  # layer 0 (weight, bias) and layer 2's weight: half on each rank
    for h, w in zip(split.history, whole.history):
        # parameters + Adam's two moments of the largest rank, against the whole model's
        assert h["state_bytes"] == pytest.approx((full - halved / 2) * 4 * 3, rel=0.02)
        assert w["state_bytes"] == pytest.approx(full * 4 * 3, rel=0.02)
    assert split.transform(df.limit(8)).count() == 8  # the fitted model is the plain module


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipeline_trains_the_weights_of_one_rank_holding_its_stage(one_rank_reference, schedule,
                                                                                tmp_path):
    df, store, whole = one_rank_reference
    trace = tmp_path / "pp2.json"
    # gpipe compiles each rank's stage (torch.compile on CPU: inductor)
    piped = _fit(df, store, numProc=2, pipelineParallel=2, pipelineSchedule=schedule, microbatches=4,
                 runId=f"pp2-{schedule}", timeline=str(trace), compile=schedule == "gpipe")
    if schedule == "gpipe":  # compiling makes the first step the slowest by far
        steps = sorted((e["dur"] for e in _spans(trace, 0) if e["name"].startswith("step ")), reverse=True)
        assert steps[0] > 20 * steps[len(steps) // 2]
    # each stage's microbatches are spans, and so is each wait for what the other stage sends
    first, last = (_names(trace, rank) for rank in (0, 1))
    for k in range(4):
        assert {f"pp forward microbatch {k} (stage 0)", f"pp backward microbatch {k} (stage 0)",
                f"pp receive gradients (microbatch {k})", f"pp send activations (microbatch {k})"} <= first
        assert {f"pp forward microbatch {k} (stage 1)", f"pp backward microbatch {k} (stage 1)",
                f"pp receive activations (microbatch {k})", f"pp send gradients (microbatch {k})"} <= last
    _same_weights(whole, piped)
    assert [h["loss"] for h in piped.history] == pytest.approx([h["loss"] for h in whole.history], abs=1e-4)
    # balanced by parameters: layers 0-3 (0 and 2 hold 576 + 4160) on one rank, layer 4 (195) on the other
    for h, w in zip(piped.history, whole.history):
        assert h["state_bytes"] == pytest.approx((576 + 4160) * 4 * 3, rel=0.02)
        assert h["state_bytes"] < w["state_bytes"]


def test_gradient_clipping_clips_the_norm_over_every_ranks_slices_and_stages(one_rank_reference):
    df, store, unclipped = one_rank_reference
    clip = dict(gradientClipNorm=0.05)
    whole = _fit(df, store, numProc=1, runId="clip-whole", **clip)
    with pytest.raises(AssertionError):
        _same_weights(unclipped, whole)  # the clip bites
    for layout in (dict(tensorParallel=2, strategy="fsdp", **PLAN), dict(pipelineParallel=2, pipelineSplit=["2"])):
        _same_weights(whole, _fit(df, store, numProc=2, runId=f"clip-{len(layout)}", **clip, **layout))


def test_bf16_mixed_precision_with_tensor_and_pipeline_parallel_trains_as_one_rank_does(one_rank_reference):
    df, store, float32 = one_rank_reference
    bf16 = dict(precision="bf16-mixed")
    whole = _fit(df, store, numProc=1, runId="bf16-whole", **bf16)
    with pytest.raises(AssertionError):
        _same_weights(float32, whole)  # bfloat16 computes otherwise
    for layout in (dict(tensorParallel=2, strategy="fsdp", **PLAN), dict(pipelineParallel=2, pipelineSplit=["2"])):
        split = _fit(df, store, numProc=2, runId=f"bf16-{len(layout)}", **bf16, **layout)
        # each split rounds its own partial products to bfloat16: not bit-equal, but no farther from the
        # one-rank bf16 weights than a few times what bfloat16 itself moves them (measured against float32)
        for key, w in _weights(whole).items():
            noise = (_weights(float32)[key] - w).norm()
            assert (_weights(split)[key] - w).norm() < 3 * noise + 1e-3 * w.norm(), (layout, key)
        assert [h["loss"] for h in split.history] == pytest.approx([h["loss"] for h in whole.history], abs=2e-3)


def test_a_non_finite_loss_on_the_last_stage_stops_every_stage_at_that_step(one_rank_reference):
    from sparkring import TrainingError

    df, store, _ = one_rank_reference
    # two microbatches a step: the last stage's 7th forward call is step 3's second microbatch
    with pytest.raises(TrainingError, match=r"non-finite loss nan at epoch 0, step 3 on rank [01]"):
        _fit(df, store, numProc=2, pipelineParallel=2, pipelineSplit=["2"], model=P.mlp_nan_at([7]), runId="pp-nan",
             timeout=60)


@pytest.mark.parametrize("first, then", [
    (dict(numProc=2, tensorParallel=2, **PLAN), dict(numProc=1)),                        # DCP -> one file
    (dict(numProc=1), dict(numProc=2, tensorParallel=2, strategy="fsdp", **PLAN)),       # one file -> DCP shards
    (dict(numProc=2, pipelineParallel=2), dict(numProc=2, tensorParallel=2, **PLAN)),    # stages -> tp slices
], ids=["tp2-then-whole", "whole-then-tp2-fsdp", "pp2-then-tp2"])
def test_a_checkpoint_resumes_at_another_layout_to_the_uninterrupted_weights(one_rank_reference, first, then):
    df, store, whole = one_rank_reference
    run_id = "layout-" + "-".join(f"{k}{v}" for k, v in sorted(first.items()) if k != "parallelizePlan")
    begun = _fit(df, store, epochs=1, runId=run_id, **first)
    resumed = _fit(df, store, epochs=2, runId=run_id, **then)
    # epoch 0 is the first fit's, timings and all (it was not trained again), and its layout's
    # per-rank state: the resumed fit's epoch 1 has its own
    assert resumed.history[0] == begun.history[0] and [h["epoch"] for h in resumed.history] == [0, 1]
    assert resumed.history[1]["state_bytes"] != begun.history[0]["state_bytes"]
    _same_weights(whole, resumed)


def test_every_composition_on_two_hosts_trains_the_weights_of_the_ranks_that_read_as_many_rows(
        spark_hosts, tmp_path):
    df = H.classification_df(spark_hosts, n=192)
    store = Store(str(tmp_path / "store"))
    one, two = (_fit(df, store, numProc=n, runId=f"whole{n}") for n in (1, 2))
    full = sum(p.numel() for p in P.mlp(width=64)().parameters())
    halved = 8 * 64 + 64 + 64 * 64
    # (Params, the fit reading as many rows per step, what the largest rank keeps in parameters)
    compositions = [
        (dict(tensorParallel=2, strategy="ddp", **PLAN), two, full - halved / 2),
        # fsdp across the groups halves what tp left: a quarter of the split layers, half of the rest
        (dict(tensorParallel=2, strategy="fsdp", **PLAN), two, halved / 4 + (full - halved) / 2),
        # stage 0 (layers 0-1: 576) and stage 1 (layers 2-4: 4160 + 195), each split over tp
        (dict(pipelineParallel=2, pipelineSplit=["2"], tensorParallel=2, **PLAN), one, (64 * 64) / 2 + 64 + 195),
        (dict(pipelineParallel=2, pipelineSplit=["2"], strategy="fsdp"), two, (4160 + 195) / 2),
        # all three at once on 8 ranks (4 tasks of 2, each a tp group): pp2 x fsdp over dp2 x tp2
        (dict(pipelineParallel=2, pipelineSplit=["2"], tensorParallel=2, strategy="fsdp", numProc=8, ranksPerTask=2,
              **PLAN), two, ((64 * 64) / 2 + 64 + 195) / 2),
    ]
    for i, (params, same_rows, kept) in enumerate(compositions):
        split = _fit(df, store, **{"numProc": 4, **params}, runId=f"composition{i}")
        _same_weights(same_rows, split)
        for h in split.history:
            assert h["state_bytes"] == pytest.approx(kept * 4 * 3, rel=0.05), params


def test_an_elastic_tensor_parallel_fit_resumes_a_lost_rank_and_goes_on_with_fewer_replicas(spark_hosts, tmp_path):
    # tp2 x dp2, each tensor-parallel group one task of two ranks (a lost executor takes whole groups)
    df = H.classification_df(spark_hosts, n=192)
    store = Store(str(tmp_path / "store"))
    elastic = dict(tensorParallel=2, ranksPerTask=2, checkpointEvery=4, minProc=2, startTimeout=30.0, **PLAN)
    jobs = spark_hosts.sparkContext.statusTracker().getJobIdsForGroup()
    refused = r"tensorParallel=2 across hosts .* set ranksPerTask to a multiple of 2"
    with pytest.raises(ConfigurationError, match=refused):
        _fit(df, store, numProc=4, **{**elastic, "ranksPerTask": 1})
    # a pipeline's microbatches need equal shares at every size: 3 x 3 rows over 2 data-parallel ranks are not
    with pytest.raises(ConfigurationError, match=r"with 2 of them a share is 4.5 rows"):
        _fit(df, store, numProc=6, ranksPerTask=2, pipelineParallel=2, batchSize=3, microbatches=3, checkpointEvery=4,
             minProc=2)
    assert spark_hosts.sparkContext.statusTracker().getJobIdsForGroup() == jobs
    whole = _fit(df, store, numProc=4, batchSize=8, runId="uninterrupted", **elastic)
    # 192 rows / global batches of 8 x 2 = 12 steps an epoch; rank 1 (of the first group) dies at its
    # 6th step: the fit launches again and goes on at the step-4 checkpoint (DCP shards of tp slices)
    marker = tmp_path / "died"
    begun = _fit(df, store, numProc=4, batchSize=8, epochs=1, runId="shrunk",
                 model=P.mlp_exits_once(str(marker), rank=1, at=6), **elastic)
    assert marker.exists() and begun.history[0]["restarts"] == 1
    # one replica fewer: the same global batches of 16 rows (one rank of dp now reads what two did)
    shrunk = _fit(df, store, numProc=2, batchSize=16, runId="shrunk", **elastic)
    assert [h["num_proc"] for h in shrunk.history] == [4, 2]
    _same_weights(whole, shrunk)


def test_a_tensor_parallel_group_is_consecutive_local_ranks_of_one_host():
    from spawn import spawn_ranks

    # ranks alternate between two hosts: rank r is local rank r // 2 of host r % 2
    places = {r: {"SPARKRING_CROSS_RANK": str(r % 2), "SPARKRING_CROSS_SIZE": "2", "SPARKRING_LOCAL_RANK": str(r // 2),
                  "SPARKRING_LOCAL_SIZE": "2", "SPARKRING_HOST_ID": f"host-{r % 2}"} for r in range(4)}
    results = spawn_ranks("parallel_fns", "mesh_layout", 4, timeout=60, rank_env=places, tp=2)
    for rank, r in enumerate(results):
        assert r["names"] == ("pp", "dp", "tp") and r["mesh"] == [[[0, 2], [1, 3]]]
        assert r["tp_group"] == ([0, 2] if rank % 2 == 0 else [1, 3])  # one host's ranks
        assert r["dp_group"] == ([0, 1] if rank in (0, 1) else [2, 3])  # one rank of each host


@pytest.fixture(scope="module")
def decoder_reference(_spark_sessions, tmp_path_factory):
    """The Llama-style decoder on one rank, with validation: what its split fits must train."""
    df = P.counting_sequences_df(_spark_sessions.get("local"))
    store = Store(str(tmp_path_factory.mktemp("decoder")))
    return df, store, _fit(df, store, numProc=1, runId="whole", **DECODER)


DECODER = dict(model=P.tiny_decoder, batchSize=32, epochs=3, fsdpWrap=["Block"], validation=0.25)


def test_a_llama_style_decoder_trains_under_the_default_plan_to_the_weights_of_one_rank(decoder_reference):
    df, store, whole = decoder_reference
    split = _fit(df, store, numProc=2, tensorParallel=2, runId="tp2", activationCheckpointing="selective", **DECODER)
    _same_weights(whole, split)
    assert split.history[-1]["loss"] < split.history[0]["loss"] * 0.7
    assert [h["val_loss"] for h in split.history] == pytest.approx([h["val_loss"] for h in whole.history], abs=1e-4)
    # attention and MLP projections split (q/k/v/gate/up by rows, o/down by columns), the rest whole
    model = P.tiny_decoder()
    total = sum(p.numel() for p in model.parameters())
    projections = sum(p.numel() for n, p in model.named_parameters() if "_proj" in n)
    assert split.history[-1]["state_bytes"] == pytest.approx((total - projections / 2) * 4 * 3, rel=0.02)


def test_an_interleaved_pipeline_cut_by_torchs_tracer_trains_the_decoder_to_the_weights_of_one_rank(
        decoder_reference):
    df, store, whole = decoder_reference
    # four stages, two per rank (stages 0 and 2 on one, 1 and 3 on the other), cut inside the model
    piped = _fit(df, store, numProc=2, pipelineParallel=2, pipelineSchedule="interleaved-1f1b",
                 pipelineSplit=["layers.0", "layers.1", "norm"], runId="pp2-interleaved", **DECODER)
    _same_weights(whole, piped)
    assert [h["val_loss"] for h in piped.history] == pytest.approx([h["val_loss"] for h in whole.history], abs=1e-4)
    assert piped.transform(df.limit(4)).count() == 4


def test_device_mesh_with_tp_in_run_trains_as_one_process_with_half_the_weights_per_rank(spark):
    results = run(P.tensor_parallel_in_run, num_proc=2, verbose=0)
    losses, weights = P.tensor_parallel_reference()
    full = sum(v.numel() for v in weights.values())
    for r in results:
        assert r["names"] == ("pp", "dp", "tp") and r["mesh"] == [[[0, 1]]]
        assert r["losses"] == pytest.approx(losses, abs=1e-5)
        assert r["local"] < full * 0.6
        for key, value in weights.items():
            torch.testing.assert_close(r["weights"][key], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("params, message", [
    (dict(tensorParallel=3, **PLAN), r"tensorParallel=3 does not divide numProc=2"),
    (dict(tensorParallel=2, parallelizePlan={"0": "colwise", "fc9": "rowwise"}), r"does not have: \['fc9'\]"),
    (dict(tensorParallel=2, parallelizePlan={"1": "colwise"}), r"'1' is a ReLU"),
    (dict(tensorParallel=2, parallelizePlan={"0": "diagonal"}), r"use one of colwise, rowwise, sequence"),
    (dict(tensorParallel=2), r"no default plan for Sequential"),
    (dict(tensorParallel=2, backend="mpi", **PLAN), r"not 'mpi'"),
    (dict(tensorParallel=2, optimizer=torch.optim.SGD(P.mlp()().parameters(), lr=0.1), **PLAN), r"as a factory"),
    (dict(tensorParallel=2, minProc=1, **PLAN), r"minProc=1 is not a multiple of tensorParallel=2 .* use minProc=2"),
    (dict(tensorParallel=2, precision="16-mixed", **PLAN), r"bf16-mixed"),
    (dict(**PLAN), r"parallelizePlan applies with tensorParallel > 1"),
    (dict(activationCheckpointing="some"), r"activationCheckpointing='some'"),
    (dict(pipelineParallel=3), r"pipelineParallel=3 does not divide numProc=2"),
    (dict(pipelineParallel=2, pipelineSplit=["2", "4"]), r"makes 2 stages, which begin at 1 split point\(s\), but "
                                                         r"pipelineSplit names 2"),
    (dict(pipelineParallel=2, pipelineSchedule="interleaved-1f1b"), r"3 block\(s\) that hold parameters, fewer than "
                                                                    r"its 4 stages"),
    (dict(pipelineParallel=2, pipelineSplit=["fc9"]), r"does not have: \['fc9'\]"),
    (dict(pipelineParallel=2, microbatches=3), r"microbatches=3 does not divide batchSize=16"),
    (dict(pipelineParallel=2, tensorParallel=2, model=P.tiny_decoder), r"needs an nn.Sequential model"),
    (dict(microbatches=2), r"microbatches applies with pipelineParallel > 1"),
    (dict(pipelineParallel=2, labelCol=["label", "id"]), r"trains one head"),
    (dict(gradientClipNorm=0.0), r"gradientClipNorm=0.0: give a positive norm"),
])
def test_what_model_parallelism_cannot_run_is_refused_before_any_spark_job(spark, tmp_path, params, message):
    df = H.classification_df(spark, n=64)
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
    with pytest.raises(ConfigurationError, match=message):
        _fit(df, Store(str(tmp_path)), numProc=2, **params)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup() == jobs
