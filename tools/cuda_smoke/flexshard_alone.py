"""europa-flexshard alone on CUDA (no europa-core, no torchtitan): the README's model,
trained a few steps on the CPU, on CUDA in fp32 and on CUDA with bf16 compute."""

import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from europa.flexshard import FlexShardOptimizer, flex_shard

README = Path(__file__).resolve().parents[2] / "packages" / "europa-flexshard" / "README.md"
code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
models: dict = {"__name__": "readme"}
exec(compile(code.split('if "RANK" in os.environ')[0], "README.md", "exec"), models)


def run(device: str, param_dtype: torch.dtype | None = None, steps: int = 6):
    torch.manual_seed(0)
    model = models["TinyMoE"]().to(device)
    layout = flex_shard(model, param_dtype=param_dtype)
    optimizer = FlexShardOptimizer(layout, lr=0.02)
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        layout.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {str(p.dtype) for _, p in layout.named_local_parameters()}


cpu, _ = run("cpu")
cuda, cuda_dtypes = run("cuda")
bf16, bf16_dtypes = run("cuda", torch.bfloat16)
print(
    json.dumps(
        {
            "cpu_fp32": cpu,
            "cuda_fp32": cuda,
            "cuda_bf16_compute": bf16,
            "max_rel_diff_fp32": max(abs(a - b) / abs(b) for a, b in zip(cuda, cpu, strict=True)),
            "storage_dtypes": sorted(cuda_dtypes | bf16_dtypes),
            "core_imported": any(m.startswith("europa.core") for m in sys.modules),
        }
    )
)
