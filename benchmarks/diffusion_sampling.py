#!/usr/bin/env python
"""Images/s of miles' diffusion sampler (engine ``diffusers``) against diffusers' own
``StableDiffusion3Pipeline`` call: the same ``SD3Transformer2DModel`` object, the same VAE, the
same flow-matching schedule (``FlowMatchEulerDiscreteScheduler``, shift 3) and number of steps,
the same initial noise and text conditioning, no classifier-free guidance, images decoded by the
VAE on both sides.

The pipeline gets the prompt embeddings precomputed (``prompt_embeds``/``pooled_prompt_embeds``:
its own text encoders expect CLIP-L/G + T5, which a tiny model has not); miles' engine takes token
ids and keeps each prompt's text-encoder outputs (the encoder is frozen, ``engine.prompt_cache``),
so its warm-up call encodes the prompts and the timed calls reuse them, as RL's repeated prompts
do. miles returns its images (and final latents, conditioning) on the host, the pipeline leaves
them on the device. Compared: the pipeline's Euler (ODE) sampler against the engine's ODE sampler
as evaluation rollouts call it (``trajectory=False``: only the final latents come back, nobody
trains on evaluations); the engine's SDE sampler (training: it also computes each step's log-prob
and copies the whole trajectory to the host) is timed too. Before timing, the two ODE samplers'
images are compared (max abs difference, of the engine's encoding call and of a reusing one).

The engine runs as configured by default: on CUDA with ``engine.cuda_graphs`` (each step's
transformer call replayed from a CUDA graph captured by the warm-up call; at these shapes
sampling is bound by the CPU launching kernels). ``miles_ode_eager`` is the same ODE sampler of
an engine built with ``cuda_graphs: false`` (the transformer's kernels launched one by one, as
the pipeline launches them); its images are checked equal to the graphs' bit for bit. On the
CPU the key is ignored and both miles ODE lines time the same code.

GPU (default): 64x64 images, a VAE with 4x downsampling (16x16x4 latents), an 8-layer
transformer (8 heads of 64), 64 images a call, 20 steps, float32.
``--device cpu``: 16x16 images, a VAE with 2x downsampling, a 2-layer transformer (2 heads of
32), 16 images a call, 10 steps, one thread. Random weights (speed does not depend on them).
Each side is warmed up once, then the sides alternate ``--repeats`` times; each side's best run
counts (other processes only ever slow a run down); each side's least thread CPU time is printed
too (on a loaded CPU host the fairer figure: one thread runs everything there).

Usage: python benchmarks/diffusion_sampling.py [--device cuda|cpu] [--repeats N] [--batch B]
       [--steps T] [--image-size S]
Ends with one line: ``diffusion_sampling images/s ratio: <x> (miles <img/s> vs diffusers <img/s>;
miles eager <img/s>, miles SDE <img/s>)``, the ratio of the default (graphs) engine's ODE sampler.
"""
from __future__ import annotations

import argparse
import time

SHAPES = {
    "cuda": dict(image_size=64, vae=[64, 64, 64], layers=8, heads=8, head_dim=64, batch=64, steps=20),
    "cpu": dict(image_size=16, vae=[16, 16], layers=2, heads=2, head_dim=32, batch=16, steps=10),
}


def build(device: str, shape: dict):
    from miles_plugin_diffusers.config import DiffusersEngineConfig, DiffusersModelConfig, ShapesEnvConfig
    from miles_plugin_diffusers.engine import DiffusersEngine
    from miles_plugin_diffusers.env import ShapesEnv
    from miles_plugin_diffusers.spec import DiffusersSpec

    spec = DiffusersSpec(DiffusersModelConfig(
        image_size=shape["image_size"], vae={"block_out_channels": shape["vae"]},
        transformer={"num_layers": shape["layers"], "num_attention_heads": shape["heads"],
                     "attention_head_dim": shape["head_dim"]}))
    tok = spec.build_tokenizer(ShapesEnv(ShapesEnvConfig()).tokenizer())
    engine = DiffusersEngine(DiffusersEngineConfig(num_steps=shape["steps"], device=device), spec=spec,
                             tokenizer=tok)
    # the same weights (the same seed) without CUDA graphs
    eager = DiffusersEngine(DiffusersEngineConfig(num_steps=shape["steps"], device=device, cuda_graphs=False),
                            spec=spec, tokenizer=tok)
    return spec, engine, eager


def pipeline(spec, engine):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(
        transformer=engine.model, scheduler=FlowMatchEulerDiscreteScheduler(shift=engine.cfg.shift),
        vae=spec.vae().to(engine.device), text_encoder=None, tokenizer=None, text_encoder_2=None,
        tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--image-size", type=int)
    ap.add_argument("--quick", action="store_true", help="CPU, 4 images, 2 steps, 1 repeat (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.device, args.repeats, args.batch, args.steps = "cpu", 1, 4, 2
    import torch

    from miles_plugin_diffusers import text

    shape = dict(SHAPES[args.device])
    for key in ("batch", "steps", "image_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if args.device == "cpu":
        torch.set_num_threads(1)
    spec, engine, eager = build(args.device, shape)
    pipe = pipeline(spec, engine)
    B, dev = shape["batch"], engine.device
    prompts = [f"a {c} square" for c in ("red", "green", "blue", "yellow")] * (B // 4 + 1)
    ids = engine.encode(prompts[:B])
    seeds = list(range(B))
    embeds, pooled = text.embed(engine.encoder, torch.tensor(ids, device=dev), engine.tokenizer.pad_token_id)
    noise = torch.stack([torch.randn((engine.channels, engine.latent_size, engine.latent_size),
                                     generator=torch.Generator().manual_seed(s)) for s in seeds]).to(dev)
    S = engine.image_size

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def run_pipe():
        return pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=shape["steps"],
                    guidance_scale=1.0, height=S, width=S, latents=noise.clone(), output_type="pt").images

    sides = {"miles_ode": lambda: engine.sample(ids, seeds, stochastic=False, trajectory=False)["images"],
             "miles_ode_eager": lambda: eager.sample(ids, seeds, stochastic=False, trajectory=False)["images"],
             "miles_sde": lambda: engine.sample(ids, seeds, stochastic=True, step_seed=1)["images"],
             "diffusers": run_pipe}
    ours, theirs = sides["miles_ode"](), sides["diffusers"]().float().cpu()  # also the warm-up
    sides["miles_sde"]()
    diff = max(float((ours - theirs).abs().max()), float((sides["miles_ode"]() - theirs).abs().max()))
    graph_diff = float((sides["miles_ode_eager"]() - ours).abs().max())
    print(f"shape {shape}, device {dev}; ODE images miles vs diffusers: max abs diff {diff:.2e}; "
          f"miles graphs vs eager: {graph_diff:.2e} (cuda_graphs {engine._graphs is not None})")
    best = {k: float("inf") for k in sides}
    cpu = dict(best)  # this thread's CPU time: on one CPU thread, what the other processes cannot inflate
    for _ in range(args.repeats):
        for name, fn in sides.items():
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.thread_time() - c0)
    rate = {k: B / v for k, v in best.items()}
    for k, v in rate.items():
        print(f"{k:15s} {v:9.1f} images/s  (best of {args.repeats}: {best[k]:.3f} s for {B} images; "
              f"thread CPU {cpu[k]:.3f} s)")
    print(f"diffusion_sampling images/s ratio: {rate['miles_ode'] / rate['diffusers']:.2f} "
          f"(miles {rate['miles_ode']:.1f} vs diffusers {rate['diffusers']:.1f}; "
          f"miles eager {rate['miles_ode_eager']:.1f}, miles SDE {rate['miles_sde']:.1f})")


if __name__ == "__main__":
    main()
