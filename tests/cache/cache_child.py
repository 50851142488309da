"""Run by test_compile_cache.py in a fresh process: compile a small model with Kiln's cache, one step,
print what happened as JSON on the last line (Kiln's log on stderr). argv: cache_dir seed out_path
[channels_last_convs switch] [model: small, or blocks: three identical blocks compiled by blocks, every
region lowered]."""
import json
import logging
import sys

import torch


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.out = torch.nn.Conv2d(16, 4, 1)

    def forward(self, x, t):
        h = torch.nn.functional.silu(self.norm(self.conv(x)))
        h = self.proj(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) + t[:, None, None, None]
        return self.out(h)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 4)

    def forward(self, x, t):
        return x + torch.nn.functional.silu(self.norm(self.conv(x))) * t[:, None, None, None]


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x, t):
        for block in self.blocks:
            x = block(x, t)
        return x


def main(cache_dir, seed, out_path, switch="auto", model="small"):
    import kiln
    from kiln.compiler.torch_compat import inductor

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(int(seed))
    module = (Small() if model == "small" else Blocks()).eval()
    torch.manual_seed(100)
    x, t = torch.randn(2, 4, 9, 7), torch.randn(2)
    options = (kiln.CompileOptions(compile_unit="blocks", measure_regions=False) if model == "blocks"
               else kiln.CompileOptions(passes={"channels_last_convs": switch}))
    compiled = kiln.compile(module, options=options, cache_dir=cache_dir)
    before = inductor.inductor_cache_counts()
    with torch.no_grad():
        out = compiled(x, t)
        eager = module(x, t)
    counts = {k: v - before[k] for k, v in inductor.inductor_cache_counts().items()}
    torch.save(out, out_path)
    stats = kiln.stats(compiled)
    print(json.dumps({"counts": counts, "events": [e.__dict__ for e in stats.cache], "fallback": stats.fallback,
                      "lowerings": [c.lowering for c in stats.compiles], "regions": len(stats.regions),
                      "max_diff_vs_eager": (out - eager).abs().max().item()}))


if __name__ == "__main__":
    main(*sys.argv[1:])
