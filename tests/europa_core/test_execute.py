"""``europa plan --execute``: a Kimi-K2-shaped model with the seed scenario's layout, executed
on fake tensors at 128 ranks (2 replicas of 16 nodes), against its plan; bad input; the fake
mode's rules."""

from __future__ import annotations

import json

import pytest
import torch

from europa.cli.app import run

# Kimi-K2's shape with 3 layers (the first dense) and the seed's layout rules: whole experts
# over an ep group spanning nodes (two-level exchange, FP8 payload, kept exchanges, at most
# 4 nodes a token), the non-expert matrices within a node, offload, overlap, recomputation.
SMALL_SEED = [
    "plan", "kimi-k2", "--hardware", "gh200-jupiter", "--replicas", "2",
    "--gpus-per-replica", "64", "-p", "flexshard", "-p", "offload", "-p", "overlap",
    "--set", "model.n_layers=3", "--set", "parallel.ep=64",
    "--set", "parallel.ep_max_nodes_per_token=4",
    "--set", 'activation_checkpointing.mode="full"', "--set", "offload.optimizer_state=true",
    "--set", 'flexshard.dense_group="node"', "--set", 'flexshard.reduce_dtype="bfloat16"',
    "--set", 'parallel.ep_dispatch_dtype="float8_e4m3fn"',
    "--set", "parallel.ep_keep_exchanges=true",
]  # fmt: skip


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_a_kimi_k2_shaped_model_executes_at_128_ranks_as_planned(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = _run(capsys, *SMALL_SEED, "--execute", "1,last", "--json")
    assert code == 0
    document = json.loads(out)
    executed = document["execution"]
    assert [e["rank"] for e in executed] == [1, 127]  # node 0, and a node of replica 1
    for rank in executed:
        device, host = rank["memory"]["device"], rank["memory"]["host"]
        assert abs(device["ratio"] - 1) <= 0.10, device
        assert abs(host["ratio"] - 1) <= 0.10, host
        planned = {(t["kind"], t["link"]) for t in rank["traffic"] if t["planned"]}
        kinds = {
            "parameter_gather",
            "gradient_reduce_scatter",
            "gradient_replica_all_reduce",
            "expert_gradient_all_reduce",
            "expert_all_to_all",
            "host_copies",
            "qk_clip_maxima",  # the preset's MuonClip: its maxima's one MAX all-reduce
        }
        assert {kind for kind, _ in planned} == kinds
        for row in rank["traffic"]:
            assert row["agrees"], row
            if row["planned"]:
                assert abs(row["ratio"] - 1) <= 0.05, row
        assert rank["agrees"]
        assert rank["stand_in"] and rank["memory"]["planned_not_executed"]["reserved"] > 0
    assert list(tmp_path.iterdir()) == []  # an execution writes nothing


def test_a_cpu_plan_of_two_nodes_executes_with_each_direct_transfer_on_its_peers_link(capsys):
    # gloo's path: FlexShard's gathers and reduce-scatters are direct transfers, each piece
    # on the link to its peer's node (rank 3's one peer on its node, two on the other), and
    # the two-level expert exchange indexes on the host with the routing model's indices
    code, out, _ = _run(capsys, "plan", "debug", "--hardware", "cpu", "-p", "flexshard",
                        "--set", "parallel.nproc=4", "--set", "parallel.ranks_per_node=2",
                        "--set", "parallel.ep=4", "--set", "training.seq_len=64",
                        "--set", "training.batch_size=1", "--set", 'training.dtype="bfloat16"',
                        "--set", 'parallel.device="cpu"', "--execute", "3", "--json")  # fmt: skip
    assert code == 0
    (rank,) = json.loads(out)["execution"]
    rows = {(t["kind"], t["link"]): t for t in rank["traffic"]}
    for kind in ("parameter_gather", "gradient_reduce_scatter", "expert_all_to_all"):
        for link in ("intra_node", "inter_node"):
            assert rows[kind, link]["planned"] > 0 and rows[kind, link]["agrees"], rows[kind, link]
    gather = rows["parameter_gather", "intra_node"], rows["parameter_gather", "inter_node"]
    assert gather[0]["executed"] * 2 == gather[1]["executed"]  # its own pieces to each peer


def test_a_pipeline_rank_executes_as_its_own_plan_with_its_stage_sends(capsys):
    # pp = 2 over two nodes of 2 (a stage a node), FlexShard with ep = 2 inside each stage,
    # 1F1B over 4 micro-batches: the last pipeline rank (its layers, the norm and the head)
    # held against its own layers' plan, the micro-batches it holds at once, and the
    # gradients it sends back to the other node
    code, out, _ = _run(capsys, "plan", "debug", "--hardware", "cpu", "-p", "flexshard",
                        "--set", "parallel.nproc=4", "--set", "parallel.ranks_per_node=2",
                        "--set", "parallel.ep=2", "--set", "parallel.pp=2",
                        "--set", "training.grad_accum_steps=4", "--set", "training.seq_len=64",
                        "--set", "training.batch_size=1", "--set", 'training.dtype="bfloat16"',
                        "--set", 'parallel.device="cpu"', "--execute", "3", "--json")  # fmt: skip
    assert code == 0
    document = json.loads(out)
    sends = {r["rank"]: r["send_bytes"] for r in document["pipeline"]["ranks"]}
    for rank in document["execution"]:
        rows = {(t["kind"], t["link"]): t for t in rank["traffic"]}
        sent = rows["pipeline_send", "inter_node"]
        assert sent["planned"] == sends[rank["rank"] // 2] > 0
        assert sent["executed"] == sent["planned"], sent
        assert rows["expert_all_to_all", "intra_node"]["agrees"]
        device = rank["memory"]["device"]
        assert abs(device["ratio"] - 1) <= 0.10, (rank["rank"], device)
        assert rank["agrees"], rank["rank"]


def test_a_context_parallel_rank_executes_its_gathers_as_planned(capsys):
    # cp = 2 on the GPU path (torch's SDPA, each chunk causal from the bottom right, on the
    # stand-in), with europa-overlap's timeline and offload, every block recomputed (a
    # second gather), FlexShard with ep = 2 beside; Kimi-K2's 64 heads at 16k tokens, where
    # the gradients SDPA returns for the whole sequence's keys and values set the peak
    code, out, _ = _run(capsys, "plan", "debug", "--hardware", "gh200-jupiter", "--replicas",
                        "1", "--gpus-per-replica", "4", "-p", "flexshard", "-p", "overlap",
                        "-p", "offload", "--set", "parallel.ep=2", "--set", "parallel.cp=2",
                        "--set", "model.n_heads=64", "--set", "model.n_layers=3",
                        "--set", "training.seq_len=16384", "--set", "training.batch_size=2",
                        "--set", 'training.dtype="bfloat16"',
                        "--set", 'activation_checkpointing.mode="full"', "--execute", "0",
                        "--json")  # fmt: skip
    assert code == 0
    (rank,) = json.loads(out)["execution"]
    rows = {(t["kind"], t["link"]): t for t in rank["traffic"]}
    gather = rows["context_gather", "intra_node"]
    scatter = rows["context_reduce_scatter", "intra_node"]
    assert gather["planned"] == 2 * scatter["planned"] > 0  # recomputed: gathered twice
    for row in (gather, scatter):
        assert row["executed"] == row["planned"], row
    assert abs(rank["memory"]["device"]["ratio"] - 1) <= 0.10, rank["memory"]["device"]
    assert rank["agrees"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--execute", "128"], "'128' is not a rank of the 128"),
        (["--execute", "0,x"], "'x' is not a rank"),
        (["--execute", "0", "--routing", "zipf"], "routing model 'zipf'"),
        (["--execute", "0", "--routing", "skew:-2"], "routing model 'skew:-2'"),
        (["--routing", "skew:1"], "--routing = 'skew:1': expected only with --execute"),
        (["--set", "training.seq_len=65536", "--execute", "0"], "--execute: kimi-k2: 128 rank(s)"),
        (["--set", 'training.dtype="float32"', "--execute", "0"], "training.dtype = 'float32'"),
    ],
)
def test_bad_execute_input_is_one_line_exit_2_and_writes_nothing(
    capsys, tmp_path, monkeypatch, extra, says
):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, *SMALL_SEED, *extra)
    assert code == 2
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "executing rank" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_fake_integer_read_is_refused_and_a_float_read_answered_and_listed():
    from europa.core.execute.fake import DataDependentRead, FakeDeviceMode

    with FakeDeviceMode() as mode:
        loss = torch.empty(3).sum()
        assert loss.item() == 1.0  # the stand-in value
        with pytest.raises(DataDependentRead, match="routing model"):
            torch.empty(3).long().sum().item()  # made from a fake tensor: fake
        index = torch.arange(5)  # host index arithmetic runs for real
        assert index.tolist() == [0, 1, 2, 3, 4]
        assert torch.empty(10**6).untyped_storage().nbytes() == 4 * 10**6  # fake, not real
    (site,) = mode.scalar_reads
    assert site.endswith(f"test_execute.py:{_line_of('loss.item()')}")


def _line_of(text: str) -> int:
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if text in line and "==" in line)


def test_nccls_rings_across_nodes_send_a_rails_share_across_as_planned(capsys):
    # FlexShard's gathers over 16 GPUs of two 8-GPU nodes on NCCL: one ring a rail, so each
    # rank sends 1/8 of its ring bytes on its own network link and the rest over NVLink,
    # in the plan and in the program's counted bytes alike
    code, out, _ = _run(capsys, "plan", "debug", "--hardware", "h100-sxm", "--nodes", "2",
                        "-p", "flexshard", "--set", 'training.dtype="bfloat16"',
                        "--execute", "9", "--json")  # fmt: skip
    assert code == 0
    (rank,) = json.loads(out)["execution"]
    rows = {(t["kind"], t["link"]): t for t in rank["traffic"]}
    for kind in ("parameter_gather", "gradient_reduce_scatter"):
        inside, across = rows[kind, "intra_node"], rows[kind, "inter_node"]
        assert inside["agrees"] and across["agrees"]
        assert inside["executed"] == pytest.approx(7 * across["executed"], rel=1e-6)
