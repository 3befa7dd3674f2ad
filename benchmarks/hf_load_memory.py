"""How much memory each rank takes to load a Hugging Face safetensors directory into an FSDP2-over-TP model.

    python benchmarks/hf_load_memory.py --dir /tmp/llama_1b_hf
    python benchmarks/hf_load_memory.py --dir /tmp/llama_4l_hf --layers 4   # a smaller model, same layer shapes

First writes a random Llama-3.2-1B-shaped ``LlamaForCausalLM`` (hidden 2048, 32 heads, 8 KV heads, MLP 8192, vocab
128256, untied; 16 layers unless ``--layers``) in bf16 to ``--dir``, unless it is there already: the model is
allocated once and ``save_safetensors`` writes it one tensor at a time. Then 4 CPU gloo ranks on a dp2 x tp2 mesh
each build the model on the meta device, shard it (TP, then FSDP2 over TP), ``to_empty`` it and time
``load_safetensors``. ``to_empty`` allocates without touching pages, so the load is where a rank's shards become
resident: a load that reads only the rank's regions grows each rank by its shards (a quarter of the model) plus
one tensor's region at most.

Prints one JSON line per rank: its local shard bytes, the peak growth of its resident memory during the load
(VmRSS sampled every 5 ms by a thread, and an upper bound from ``ru_maxrss``, which is the peak since the process
started) and the load time; then a summary line with the largest growth as a fraction of the whole model's bytes.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_strategy.checkpoint.hf_safetensors import load_safetensors, save_safetensors
from titan_strategy.shards import local

NPROC = 4
SAMPLE_S = 0.005
_TP_PLAN = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
            **{f"model.layers.*.{name}": ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj",
                                                                         "self_attn.v_proj", "mlp.gate_proj",
                                                                         "mlp.up_proj")},
            **{f"model.layers.*.{name}": RowwiseParallel() for name in ("self_attn.o_proj", "mlp.down_proj")}}


def llama_1b_config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    tie_word_embeddings=False, dtype="bfloat16")


def write_random_model(directory: Path, layers: int) -> None:
    """A random bf16 Llama in ``directory``: built on the meta device and allocated once, then saved."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_1b_config(layers)).to(torch.bfloat16)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    save_safetensors(model, directory)


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


class PeakRss:
    """The largest VmRSS a background thread sees, every ``SAMPLE_S``, while the context is open."""

    def __init__(self) -> None:
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(SAMPLE_S)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _sharded_on_meta(directory: Path) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parallelize_module(model, mesh["tp"], _TP_PLAN)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _rank(rank: int, port: int, directory: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NPROC,
                            timeout=timedelta(seconds=600))
    try:
        model = _sharded_on_meta(directory)
        model.to_empty(device="cpu")
        local_bytes = sum(local(param).numel() * param.dtype.itemsize for param in model.parameters())
        dist.barrier()
        before = _rss_bytes()
        start = time.perf_counter()
        with PeakRss() as peak:
            load_safetensors(model, directory)
        seconds = time.perf_counter() - start
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        record = {"rank": rank, "local_shard_bytes": local_bytes, "rss_before_load": before,
                  "peak_growth_sampled": peak.peak - before, "peak_growth_upper_bound": max_rss - before,
                  "load_s": round(seconds, 2)}
        records: list[dict] = [{} for _ in range(NPROC)]
        dist.all_gather_object(records, record)
        if rank == 0:
            _report(records, directory)
    finally:
        dist.destroy_process_group()


def _report(records: list[dict], directory: Path) -> None:
    model_bytes = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    for record in records:
        print(json.dumps(record))
    worst = max(record["peak_growth_sampled"] for record in records)
    print(json.dumps({"model_bytes": model_bytes, "max_peak_growth_sampled": worst,
                      "peak_growth_over_model": round(worst / model_bytes, 4),
                      "max_local_shard_over_model": round(max(r["local_shard_bytes"] for r in records) / model_bytes,
                                                          4),
                      "max_overhead_over_shards_bytes": max(r["peak_growth_sampled"] - r["local_shard_bytes"]
                                                            for r in records)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="the safetensors directory (written if absent)")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16 is Llama-3.2-1B)")
    args = parser.parse_args()
    if not args.dir.exists():  # save_safetensors publishes a directory only once it is complete
        start = time.perf_counter()
        # In a process of its own: ranks started from this one would carry its peak in their ``ru_maxrss``.
        writer = mp.get_context("spawn").Process(target=write_random_model, args=(args.dir, args.layers))
        writer.start()
        writer.join()
        if writer.exitcode != 0:
            raise RuntimeError(f"writing the random model to {args.dir} failed (exit code {writer.exitcode})")
        print(json.dumps({"wrote": str(args.dir), "write_s": round(time.perf_counter() - start, 1)}))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Fresh interpreters: a forked rank would start with this process's pages.
    mp.start_processes(_rank, args=(port, args.dir), nprocs=NPROC, start_method="spawn")


if __name__ == "__main__":
    main()
