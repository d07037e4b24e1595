"""Which 8-bit code for Adam's moments: a small measured comparison ([Note: quantized state] in
zerofast/quant.py). Not a pytest benchmark: `python benchmarks/quant_codes.py` prints a table.

The moments are real: a GPT (n_embd 128, 4 layers) trained for 200 steps on the shipped text with
torch.optim.AdamW (lr 1e-3), then its exp_avg and exp_avg_sq quantized block-wise (block 256) with
each code. Reported per code, over every element:
- m: median and 99th percentile of |m_q - m| / |m| (relative error of the first moment),
- v: the same for the second moment,
- update: median and 99th percentile of the relative error of the Adam direction m / (sqrt(v) + eps),
  the quantity the parameters move by, and the fraction of elements whose v rounds to zero.
"""

from __future__ import annotations

import torch

from zerofast.quant import dynamic_code, thresholds
from zerofast.tools.data import corpus_tokens, text_batch
from zerofast.tools.models import make_gpt

BLOCK = 256
EPS = 1e-8


def linear_code(signed: bool) -> torch.Tensor:
    """Evenly spaced: signed -1..1 (255 values and 0 twice: 256), unsigned 0..1."""
    if signed:
        return torch.cat([torch.linspace(-1, 1, 255), torch.tensor([0.0])]).sort().values
    return torch.linspace(0, 1, 256)


def linear_no_zero_code() -> torch.Tensor:
    """Li et al.'s unsigned linear map without zero: (k + 1) / 256."""
    return torch.arange(1, 257, dtype=torch.float64).div(256).float()


def roundtrip(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True)
    norm = torch.where(scale > 0, blocks / scale.clamp_min(1e-38), torch.zeros_like(blocks))
    q = torch.searchsorted(thresholds(code), norm.contiguous())
    return (code[q] * scale).view(-1)


def trained_moments(steps: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    model = make_gpt("small", n_embd=64, n_layer=2, n_head=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = corpus_tokens()
    for step in range(steps):
        x, y = text_batch(tokens, 4, 64, step)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    ms, vs = [], []
    for p in model.parameters():
        st = opt.state[p]
        pad = (-p.numel()) % BLOCK
        ms.append(torch.nn.functional.pad(st["exp_avg"].reshape(-1), (0, pad)))
        vs.append(torch.nn.functional.pad(st["exp_avg_sq"].reshape(-1), (0, pad)))
    return torch.cat(ms), torch.cat(vs)


def rel(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((a - b).abs() / b.abs())[mask]


def main() -> None:
    torch.manual_seed(0)
    m, v = trained_moments()
    nonzero = (m != 0) & (v != 0)
    u = m / (v.sqrt() + EPS)
    candidates = {
        "linear m / linear v": (linear_code(True), linear_code(False)),
        "dynamic m / linear-no-zero v": (dynamic_code(True), linear_no_zero_code()),
        "dynamic m / dynamic v": (dynamic_code(True), dynamic_code(False)),
    }
    print(f"{int(nonzero.sum())} elements; block {BLOCK}")
    print("code | m rel err p50 / p99 | v rel err p50 / p99 | update rel err p50 / p99 | v -> 0")
    for name, (cm, cv) in candidates.items():
        mq, vq = roundtrip(m, cm), roundtrip(v, cv)
        uq = mq / (vq.sqrt() + EPS)
        em, ev, eu = rel(mq, m, nonzero), rel(vq, v, nonzero), rel(uq, u, nonzero)
        zero = ((vq == 0) & nonzero).float().mean().item()
        q = torch.tensor([0.5, 0.99], dtype=torch.float64)
        pm, pv, pu = (torch.quantile(e.double()[:1_000_000], q).tolist() for e in (em, ev, eu))
        print(
            f"{name} | {pm[0]:.3g} / {pm[1]:.3g} | {pv[0]:.3g} / {pv[1]:.3g} | {pu[0]:.3g} / {pu[1]:.3g} | {zero:.3%}"
        )


if __name__ == "__main__":
    main()
