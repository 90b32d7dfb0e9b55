"""Model spec ``diffusers``: an SD3 flow-matching transformer, conditioned on a frozen CLIP text
encoder, in pixel space or in the latent space of a frozen ``AutoencoderKL`` (``model.vae``).
The trainable module is the transformer; the spec keeps the rest."""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch
from miles import MilesError

from . import sde, text
from .config import DiffusersModelConfig, vae_config, vae_factor
from .forward import OldPolicy, velocities

CHANNELS = 3  # pixel space: the transformer denoises RGB images in [-1, 1]
# warm-started weights by (model settings, vocabulary): a run builds the model several times
# (engine, trainer, export, resume) and pretraining is deterministic, so it runs once per process
_WARM: dict[str, dict[str, torch.Tensor]] = {}
_WARM_VAE: dict[str, torch.nn.Module] = {}


class DiffusersSpec:
    def __init__(self, cfg: DiffusersModelConfig):
        self.cfg = cfg
        self._encoder: torch.nn.Module | None = None
        self._vae: torch.nn.Module | None = None
        self._old = OldPolicy()  # forward-process scoring's old policy (empty until first used)
        self.warm_losses: list[float] = []
        self.vae_losses: list[float] = []

    # -- tokenizer and conditioning ----------------------------------------------------------------
    def build_tokenizer(self, default: Any = None) -> Any:
        if self.cfg.path is not None:
            from transformers import PreTrainedTokenizerFast

            folder = os.path.join(self.cfg.path, "tokenizer")
            if not os.path.isdir(folder):
                raise MilesError(f"model.path {self.cfg.path} has no tokenizer/ folder")
            return PreTrainedTokenizerFast.from_pretrained(folder)
        if default is None:
            raise MilesError("model 'diffusers' needs a tokenizer: set model.path to a folder written by "
                             "miles export, or use an env that offers one (e.g. env.name: shapes)")
        return default

    def text_encoder(self, tokenizer: Any) -> torch.nn.Module:
        """The frozen text encoder (random from ``model.seed``, or the folder's)."""
        if self._encoder is None:
            if self.cfg.path is not None:
                from transformers import CLIPTextModelWithProjection

                enc = CLIPTextModelWithProjection.from_pretrained(os.path.join(self.cfg.path, "text_encoder"))
                self._encoder = enc.eval().requires_grad_(False)
            else:
                self._encoder = text.clip_encoder(tokenizer, self.cfg.text_hidden, self.cfg.text_layers,
                                                  self.cfg.max_length, self.cfg.seed)
        return self._encoder

    def max_length(self) -> int:
        if self.cfg.path is not None:
            return int(self.text_encoder(None).config.max_position_embeddings)
        return self.cfg.max_length

    # -- the trainable transformer -----------------------------------------------------------------
    def transformer_config(self) -> dict[str, Any]:
        t = dict(self.cfg.transformer)
        heads, head_dim = t.setdefault("num_attention_heads", 2), t.setdefault("attention_head_dim", 32)
        patch = t.setdefault("patch_size", 2)
        t.setdefault("num_layers", 2)
        t.setdefault("caption_projection_dim", heads * head_dim)
        t.setdefault("joint_attention_dim", self.cfg.text_hidden)
        t.setdefault("pooled_projection_dim", self.cfg.text_hidden)
        side = self.cfg.image_size // vae_factor(self.cfg.vae)  # what the transformer denoises
        t.setdefault("sample_size", side)
        t.setdefault("pos_embed_max_size", max(side // patch, 1))
        channels = CHANNELS if self.cfg.vae is None else int(self.vae_settings()["latent_channels"])
        t.update(in_channels=channels, out_channels=channels)
        return t

    # -- pixel or latent space ---------------------------------------------------------------------
    def vae_settings(self) -> dict[str, Any]:
        return vae_config(self.cfg.vae or {}, self.cfg.image_size)

    def vae(self) -> torch.nn.Module | None:
        """The frozen AutoencoderKL (the folder's ``vae/``, or random from ``model.seed`` and
        trained on the shapes set with ``warm_start``), or None in pixel space."""
        if self._vae is None:
            from diffusers import AutoencoderKL

            if self.cfg.path is not None:
                folder = os.path.join(self.cfg.path, "vae")
                self._vae = AutoencoderKL.from_pretrained(folder) if os.path.isdir(folder) else None
            elif self.cfg.vae is not None:
                self._vae = self._inline_vae(AutoencoderKL)
            if self._vae is not None:
                self._vae.eval().requires_grad_(False)
        return self._vae

    def _inline_vae(self, cls: Any) -> torch.nn.Module:
        key = self.cfg.model_dump_json()
        if key in _WARM_VAE:
            return _WARM_VAE[key]
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.cfg.seed)
                vae = cls(**self.vae_settings())
        except TypeError as e:
            raise MilesError(f"model.vae: {e}; keys are AutoencoderKL's arguments") from e
        if self.cfg.warm_start is not None and self.cfg.warm_start.vae_steps:
            from .warmstart import pretrain_vae

            with torch.random.fork_rng(devices=[]), torch.enable_grad():  # callers may be in no_grad
                self.vae_losses = pretrain_vae(vae, self.cfg.warm_start, self.cfg.image_size)
        _WARM_VAE.clear()
        _WARM_VAE[key] = vae
        return vae

    def vae_factor(self) -> int:
        """Pixels per latent along a side (1 in pixel space)."""
        vae = self.vae()
        return 1 if vae is None else 2 ** (len(vae.config.block_out_channels) - 1)

    def _vae_on(self, device: torch.device) -> torch.nn.Module | None:
        vae = self.vae()
        if vae is not None and next(vae.parameters()).device != device:  # .to() walks every module
            vae.to(device)
        return vae

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] -> what the transformer denoises (pixels in [-1, 1],
        or the VAE posterior's mode, shifted and scaled as SD3's pipeline expects)."""
        vae = self._vae_on(images.device)
        if vae is None:
            return images * 2 - 1
        shift = vae.config.shift_factor or 0.0
        return (vae.encode(images * 2 - 1).latent_dist.mode() - shift) * vae.config.scaling_factor

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """The transformer's output space -> images ``[B, 3, H, W]`` in [0, 1]."""
        vae = self._vae_on(x.device)
        if vae is not None:
            x = vae.decode(x / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)).sample
        return ((x + 1) / 2).clamp(0, 1)

    def build_model(self, tokenizer: Any) -> torch.nn.Module:
        from diffusers import SD3Transformer2DModel

        if self.cfg.path is not None:
            return SD3Transformer2DModel.from_pretrained(os.path.join(self.cfg.path, "transformer"))
        try:
            with torch.random.fork_rng(devices=[]):  # the same initial weights whatever the caller's RNG
                torch.manual_seed(self.cfg.seed)
                model = SD3Transformer2DModel(**self.transformer_config())
        except TypeError as e:
            raise MilesError(f"model.transformer: {e}; keys are SD3Transformer2DModel's arguments") from e
        if self.cfg.warm_start is not None:
            key = self.cfg.model_dump_json() + repr(sorted(tokenizer.get_vocab().items()))
            if key not in _WARM:
                from .warmstart import pretrain

                with torch.random.fork_rng(devices=[]):
                    self.warm_losses = pretrain(model, self.text_encoder(tokenizer), tokenizer,
                                                self.cfg.warm_start, self.cfg.image_size, self.cfg.max_length,
                                                self.encode_images)
                _WARM.clear()  # one model's weights at a time
                _WARM[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(_WARM[key])
        return model

    def image_size(self, model: torch.nn.Module) -> int:
        """The image side in pixels."""
        if self.cfg.path is not None:
            return int(model.config.sample_size) * self.vae_factor()
        return self.cfg.image_size

    # -- scoring: the Flow-GRPO transition log-probs -----------------------------------------------
    def action_logprobs(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Log-prob ``[B, T]`` of each recorded SDE transition ``latents[:, t] -> latents[:, t+1]``
        under ``model``; steps no row trains on (``loss_mask`` 0 everywhere) are 0 and skipped.
        A forward-process batch (``extras["x_t"]``, see ``forward.py``) gets velocities instead."""
        if "x_t" in batch.extras:
            return velocities(model, batch.extras, batch.samples, self._old)
        return trajectory_logprobs(model, batch.extras, batch.loss_mask)

    # -- training state: the forward-process old policy, checkpointed by trainers ------------------
    def training_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The old policy's EMA weights and version for ``model`` (``KeepsTrainingState``)."""
        return self._old.state(model)

    def load_training_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self._old.load_state(model, state)

    # -- export ------------------------------------------------------------------------------------
    def save_pretrained(self, named: Iterable[tuple[str, torch.Tensor]], tokenizer: Any, path: str) -> None:
        """A diffusers-style folder: transformer/, text_encoder/, tokenizer/, scheduler/ (and vae/
        in latent space)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        model = self._bare() if self.cfg.path is None else self.build_model(tokenizer)  # weights: ``named``
        model.load_state_dict({k: v.detach().cpu() for k, v in named})
        model.save_pretrained(os.path.join(path, "transformer"))
        self.text_encoder(tokenizer).save_pretrained(os.path.join(path, "text_encoder"))
        tokenizer.save_pretrained(os.path.join(path, "tokenizer"))
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(os.path.join(path, "scheduler"))
        if self.vae() is not None:
            self.vae().to("cpu").save_pretrained(os.path.join(path, "vae"))

    def _bare(self) -> torch.nn.Module:
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel(**self.transformer_config())


def trajectory_logprobs(model: torch.nn.Module, extras: dict, loss_mask: torch.Tensor) -> torch.Tensor:
    """See ``DiffusersSpec.action_logprobs``: ``extras`` holds ``latents`` ``[B, T+1, C, H, W]``,
    ``sigmas`` ``[B, T+1]``, ``embeds``/``pooled`` (and ``neg_*`` with guidance), ``eta``, ``guidance``."""
    lat, sig = extras["latents"], extras["sigmas"]
    B, T = lat.shape[0], lat.shape[1] - 1
    eta, guidance = float(extras["eta"]), float(extras["guidance"])
    cond = {k: extras[k] for k in ("embeds", "pooled", "neg_embeds", "neg_pooled") if k in extras}
    cols = []
    for t in range(T):
        if not bool((loss_mask[:, t] != 0).any()):
            cols.append(torch.zeros(B, dtype=lat.dtype, device=lat.device))
            continue
        v = sde.velocity(model, lat[:, t], sig[:, t], cond, guidance)
        mean, std = sde.sde_mean_std(lat[:, t], v, sig[:, t], sig[:, t + 1], sig[:, 1], eta)
        cols.append(sde.gaussian_logprob(lat[:, t + 1], mean, std))
    return torch.stack(cols, dim=1)
