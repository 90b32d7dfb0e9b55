"""Hugging Face config -> megatron-core ``GPTModel`` (local layer spec, no Transformer Engine).

``Arch`` is the handful of facts the builder and the weight converter need, read once from a
Hugging Face config of a built-in family (Llama, Qwen2, Qwen3, Qwen3-MoE) or, for any other
family, from its architecture plugin (``miles.protocols.BuildsMegatron``: multi-latent attention,
sigmoid routing with expert bias and groups, shared experts, dense layers among MoE ones).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from miles import MilesError

from .attention import SDPAttention
from .rope import rope_fields, set_yarn

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Arch:
    family: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_positions: int
    eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: int = 0  # 0 = dense
    topk: int = 0
    moe_ffn: int = 0
    norm_topk: bool = True
    # from an architecture plugin (BuildsMegatron); the defaults are the built-in families'
    q_lora_rank: int | None = None  # multi-latent attention (kv_lora_rank > 0); None: no query LoRA
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    latent_eps: float | None = None  # the latent RMSNorms' epsilon, where it is not ``eps``
    rotary_fraction: float = 1.0  # RoPE on the first fraction of each head (GLM: 0.5)
    score: str = "softmax"  # router: softmax over experts, or a sigmoid per expert
    expert_bias: bool = False  # a selection-only bias per expert (sigmoid routing)
    groups: int = 0  # group-limited top-k: experts in ``groups`` groups, ``group_topk`` of them chosen
    group_topk: int = 0
    scaling: float | None = None  # routed experts' weights scaled by this
    shared_ffn: int = 0  # shared experts' total FFN size (0: none)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense FFN of size ``ffn``
    shared_gate: bool = False  # the shared experts' output scaled by a learned sigmoid gate per token
    shared_hf: str = "shared_experts"  # the HF module name of the shared experts (Qwen: shared_expert)
    zero_centered_norms: bool = False  # every RMSNorm scales by 1 + weight (Qwen3-Next, Qwen3.5)
    attention_gate: bool = False  # a sigmoid gate per attention output channel, from q_proj
    # gated DeltaNet linear attention (its module: the architecture's EditsMegatronLayers edit)
    linear_layers: tuple[int, ...] = ()  # layers whose attention is linear (the rest: softmax attention)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 0  # the causal convolution's kernel size
    linear_grouped: bool = False  # HF packs the projections per key head (in_proj_qkvz, in_proj_ba)
    linear_bias: bool = False  # biases on the attention output, expert and router projections too
    sinks: bool = False  # a learned per-head logit beside the keys in each softmax (megatron "learnable")
    # DeepSeek sparse attention (MLA keys picked per query by an indexer's top-k; its module: the
    # architecture's EditsMegatronLayers edit); 0: dense attention
    index_topk: int = 0
    index_heads: int = 0
    index_dim: int = 0
    window: int = 0  # sliding window: a query sees itself and the ``window - 1`` tokens before it
    window_layers: tuple[int, ...] = ()  # the layers with that window (the others attend fully)
    glu_alpha: float | None = None  # gate activation x * sigmoid(alpha * x) (None: SiLU)
    glu_limit: float | None = None  # gate clamped above, linear half clamped to +-limit
    glu_offset: float = 0.0  # added to the linear half of the GLU
    hf_router: str = "gate"  # the router's module name under ``mlp.`` in Hugging Face names
    hf_experts: str = "stacked"  # "interleaved": gpt-oss' [E, H, 2I] gate/up columns alternating, biases
    # YaRN (``yarn_factor`` > 1; 1: plain RoPE), as transformers' ``rope_parameters`` give it
    yarn_factor: float = 1.0
    yarn_original_max: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True  # correction range rounded to whole dimensions
    yarn_mscale: tuple[float, float] | None = None  # (mscale, mscale_all_dim); None: from the factor alone
    # DeepSeek-V4: ``hc_mult`` residual streams (hyper.py; 1: one), hash-routed MoE layers (routing.py),
    # and an attention that is transformers' own module, held by the architecture's edit (split by head)
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    hash_layers: tuple[int, ...] = ()
    hf_attention: bool = False
    out_groups: int = 0  # the held attention's grouped output projection: TP splits heads in whole groups

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` (0-based, across the model) has an MoE FFN."""
        return self.moe and i not in self.dense_layers

    @property
    def whole_experts(self) -> bool:
        """Whether the experts stay whole on every tensor-parallel rank (expert tensor parallel 1):
        megatron-core runs experts with biases only so."""
        return self.moe and self.linear_bias

    def expert_tp(self, tp: int) -> int:
        """The experts' tensor-parallel size at ``tp``."""
        return 1 if self.whole_experts else tp

    def padded_vocab(self, tp: int) -> int:
        """Megatron's vocab-parallel embedding needs rows divisible by the TP size."""
        return -(-self.vocab // tp) * tp


def arch_of(hf: Any, architecture: Any = None) -> Arch:
    """The ``Arch`` of a transformers ``PretrainedConfig``; unsupported features are errors.
    ``architecture``: the model's registered ``Architecture`` (None: none registered), which
    describes a family outside ``FAMILIES`` if it ``BuildsMegatron``."""
    from miles.protocols import BuildsMegatron

    family = getattr(hf, "model_type", None)
    if family not in FAMILIES:
        if isinstance(architecture, BuildsMegatron):
            return _described(hf, architecture)
        raise MilesError(f"trainer megatron: model_type {family!r} is not supported (supported: "
                         f"{', '.join(FAMILIES)}, and families whose architecture plugin builds Megatron "
                         f"models); use trainer.name=fsdp2 for other architectures")
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    heads = hf.num_attention_heads
    experts = getattr(hf, "num_experts", 0) if family == "qwen3_moe" else 0
    if experts and (getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1):
        raise MilesError("trainer megatron: Qwen3-MoE with dense layers (mlp_only_layers, "
                         "decoder_sparse_step != 1) is not supported")
    return Arch(
        family=family, num_layers=hf.num_hidden_layers, hidden=hf.hidden_size, heads=heads,
        kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        ffn=hf.intermediate_size, vocab=hf.vocab_size, max_positions=hf.max_position_embeddings,
        eps=hf.rms_norm_eps, tied=bool(hf.tie_word_embeddings),
        qkv_bias=family == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        experts=experts, topk=getattr(hf, "num_experts_per_tok", 0) if experts else 0,
        moe_ffn=getattr(hf, "moe_intermediate_size", 0) if experts else 0,
        norm_topk=bool(getattr(hf, "norm_topk_prob", True)), **rope_fields(hf, rope))


def _described(hf: Any, architecture: Any) -> Arch:
    """The ``Arch`` of a family its architecture plugin describes: the common transformer sizes
    from the config, the rest from ``megatron_arch``."""
    import dataclasses

    fields = architecture.megatron_arch(hf)
    known = {f.name for f in dataclasses.fields(Arch)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise MilesError(f"trainer megatron: the {hf.model_type} architecture plugin names unknown Arch "
                         f"fields {unknown} (known: {sorted(known)})")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    heads = hf.num_attention_heads
    base = dict(family=hf.model_type, num_layers=hf.num_hidden_layers, hidden=hf.hidden_size, heads=heads,
                kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
                ffn=getattr(hf, "intermediate_size", 0),  # Qwen3.5 MoE: experts only
                vocab=hf.vocab_size, max_positions=hf.max_position_embeddings,
                eps=hf.rms_norm_eps, tied=bool(hf.tie_word_embeddings),
                qkv_bias=bool(getattr(hf, "attention_bias", False)), qk_norm=False)
    return Arch(**{**base, **rope_fields(hf, rope, mla=fields.get("kv_lora_rank", 0) > 0), **fields})


def transformer_config(arch: Arch, *, tp: int = 1, pp: int = 1, ep: int = 1, vp: int = 1,
                       params_dtype: torch.dtype = torch.float32, fused: bool = False) -> Any:
    """A megatron-core ``TransformerConfig`` that computes what the Hugging Face model computes.
    ``fused``: megatron-core's fused SwiGLU (one compiled kernel forward and backward instead of
    four elementwise passes over the FFN activations; torch.compile, so CUDA only here)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = {}
    if arch.moe:
        kw.update(num_moe_experts=arch.experts, moe_router_topk=arch.topk, moe_ffn_hidden_size=arch.moe_ffn,
                  # HF: softmax over all experts, top-k, renormalise when norm_topk_prob; Megatron's
                  # top-k-then-softmax is that renormalised form, pre-softmax the other
                  moe_router_pre_softmax=not arch.norm_topk, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                  moe_permute_fusion=False, moe_router_dtype="fp32",  # sqrt-softplus: routing.py scores
                  moe_router_score_function="sigmoid" if arch.score == "sqrtsoftplus" else arch.score,
                  moe_router_enable_expert_bias=arch.expert_bias,
                  moe_router_topk_scaling_factor=arch.scaling,
                  moe_layer_freq=[int(arch.moe_layer(i)) for i in range(arch.num_layers)],
                  expert_tensor_parallel_size=arch.expert_tp(tp))
        if arch.groups > 1:
            kw.update(moe_router_num_groups=arch.groups, moe_router_group_topk=arch.group_topk)
        if arch.shared_ffn:
            kw.update(moe_shared_expert_intermediate_size=arch.shared_ffn, moe_shared_expert_gate=arch.shared_gate)
    if arch.linear_layers:
        # megatron-core's own description of a hybrid stack (1 = linear attention); the module that
        # reads it is the architecture's, put in by its layer-spec edit
        kw.update(linear_attention_freq=[int(i in arch.linear_layers) for i in range(arch.num_layers)],
                  linear_conv_kernel_dim=arch.linear_conv, linear_key_head_dim=arch.linear_key_dim,
                  linear_value_head_dim=arch.linear_value_dim, linear_num_key_heads=arch.linear_key_heads,
                  linear_num_value_heads=arch.linear_value_heads)
    if arch.attention_gate:
        kw.update(attention_output_gate=True)
    if arch.zero_centered_norms:
        kw.update(layernorm_zero_centered_gamma=True)
    if arch.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig as TransformerConfig

        # plain RoPE on the positional part (no YaRN: scaling factor 1 keeps the softmax scale
        # 1/sqrt(q_head_dim)); megatron-core de-interleaves it as DeepSeek's checkpoints store it
        kw.update(multi_latent_attention=True, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                  qk_head_dim=arch.qk_nope_dim, qk_pos_emb_head_dim=arch.qk_rope_dim, v_head_dim=arch.v_head_dim,
                  rope_type="rope", rotary_base=arch.rope_theta, rotary_scaling_factor=1.0,
                  rotary_percent=arch.rotary_fraction)
    if arch.index_topk:  # megatron-core's MLA then hands its core attention the layer input and query latent
        kw.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=arch.index_heads,
                  dsa_indexer_head_dim=arch.index_dim, dsa_indexer_topk=arch.index_topk)
    if arch.sinks:
        kw.update(softmax_type="learnable")
    if arch.window:  # megatron-core's (left, right) window: ``window - 1`` tokens back, none ahead
        kw.update(window_size=(arch.window - 1, 0),
                  window_attn_skip_freq=[int(i in arch.window_layers) for i in range(arch.num_layers)])
    activation = torch.nn.functional.silu
    if arch.glu_alpha is not None:
        # the clamped GLU runs megatron-core's unfused path (its fused kernels take no clamp with a bias)
        kw.update(glu_linear_offset=arch.glu_offset, activation_func_clamp_value=arch.glu_limit)
        activation, fused = _sigmoid_gelu(arch.glu_alpha), False
    elif arch.glu_limit is not None:  # SiLU with the clamps (DeepSeek-V4's swiglu_limit): unfused path
        kw.update(activation_func_clamp_value=arch.glu_limit)
        fused = False
    config = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden, num_attention_heads=arch.heads,
        num_query_groups=arch.kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn,
        normalization="RMSNorm", layernorm_epsilon=arch.eps, gated_linear_unit=True,
        activation_func=activation, add_bias_linear=arch.linear_bias, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm or arch.mla, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, bias_activation_fusion=fused, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        use_cpu_initialization=True, perform_initialization=False, **kw)
    if arch.yarn_factor > 1:
        set_yarn(config, arch)
    return config


def _sigmoid_gelu(alpha: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x * sigmoid(alpha * x)`` in plain torch (megatron-core's ``quick_gelu`` fixes alpha at 1.702
    and is torch.compile'd, which its unfused GLU path does not need)."""
    return functools.partial(_scaled_sigmoid_gelu, alpha=alpha)


def _scaled_sigmoid_gelu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)


def fp32_router() -> type:
    """megatron-core's top-k router with its gating GEMM outside autocast: under bf16 autocast its
    custom GEMM returns bf16 logits while its backward multiplies them with the fp32 weight (a
    dtype error); outside autocast the logits are fp32 (``moe_router_dtype``) forward and back."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    if not hasattr(moe_utils, "te_general_gemm"):
        # 0.16.1's gating GEMM tests this Transformer Engine name, which it binds only where TE
        # imports: without TE every MoE forward raised NameError, and None takes its torch path
        moe_utils.te_general_gemm = None

    class FP32Router(TopKRouter):
        def gating(self, input: torch.Tensor) -> torch.Tensor:
            with torch.autocast(input.device.type, enabled=False):
                return super().gating(input)

    return FP32Router


@functools.cache  # one pair of classes per process: models built apart share them
def one_rank_linears() -> tuple[type, type]:
    """megatron-core's column- and row-parallel linears for a tensor-parallel size of 1, with a
    plain ``F.linear`` forward. Theirs run an autograd function that torch.compile cannot trace
    (a graph break at every projection, so a compiled layer stays eight small graphs) and copies
    non-contiguous gradients in backward; with one rank there is nothing to communicate, and the
    weights, bias handling and checkpoint layout are the parents'."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class OneRankColumnLinear(ColumnParallelLinear):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            weight = self.weight if weight is None else weight
            bias = None if self.skip_bias_add else self.bias
            return F.linear(input_, weight, bias), (self.bias if self.skip_bias_add else None)

    class OneRankRowLinear(RowParallelLinear):
        def forward(self, input_):
            if self.skip_bias_add:
                return F.linear(input_, self.weight), self.bias
            return F.linear(input_, self.weight, self.bias), None

    return OneRankColumnLinear, OneRankRowLinear


def replace_module(builder: Any, old: type, new: type) -> Any:
    """A spec entry (``ModuleSpec`` in megatron-core 0.16, ``functools.partial`` in 0.19) that
    builds ``new`` where it names ``old``; any other entry as it is."""
    if isinstance(builder, functools.partial):
        return functools.partial(new, *builder.args, **builder.keywords) if builder.func is old else builder
    if getattr(builder, "module", None) is old:
        builder.module = new
    return builder


def _submodules(builder: Any) -> Any:
    """The submodules of a spec entry: a ``ModuleSpec`` (megatron-core 0.16) or a
    ``functools.partial(Module, submodules=...)`` (0.19)."""
    if isinstance(builder, functools.partial):
        return builder.keywords.get("submodules")
    return getattr(builder, "submodules", None)


def layer_spec(arch: Arch, edit: Callable[[Any], Any] | None = None, tp: int = 1, moe: bool | None = None) -> Any:
    """The local (no Transformer Engine) GPT layer spec with SDPA core attention, and with one
    tensor-parallel rank ``one_rank_linears`` for the attention and dense MLP projections.
    ``edit``: a model spec's ``megatron_layer_spec(layer_spec)`` hook, which may swap any submodule
    (e.g. a custom router or attention output gate) before the model is built. ``moe``: an MoE
    FFN (default: whether the model has experts)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    moe = arch.moe if moe is None else moe
    spec = get_gpt_layer_local_spec(num_experts=arch.experts if moe else None, moe_grouped_gemm=False,
                                    qk_layernorm=arch.qk_norm or arch.mla, multi_latent_attention=arch.mla,
                                    normalization="RMSNorm")
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = SDPAttention
    if arch.mla:
        _mla_without_te()
    if arch.mla and arch.latent_eps is not None and arch.latent_eps != arch.eps:
        attn.q_layernorm = attn.kv_layernorm = _with_eps(attn.kv_layernorm, arch.latent_eps)
    mlp = _submodules(spec.submodules.mlp)
    if tp == 1 and not arch.mla:
        column, row = one_rank_linears()
        attn.linear_qkv, attn.linear_proj = column, row
        if not moe and mlp is not None:
            mlp.linear_fc1, mlp.linear_fc2 = column, row
    if moe and mlp is not None and hasattr(mlp, "router"):
        from .routing import grouped_sigmoid_router, router_class

        if arch.score == "sqrtsoftplus":
            mlp.router = router_class(arch)
        elif arch.groups > 1 and arch.topk != 2 * arch.group_topk:  # megatron-core ranks groups otherwise
            mlp.router = grouped_sigmoid_router()
        else:
            mlp.router = fp32_router()
    if moe and mlp is not None and hasattr(mlp, "experts"):
        from megatron.core.transformer.moe.experts import SequentialMLP

        from .experts import GroupedExperts

        # local experts as grouped GEMMs, not one MLP each
        mlp.experts = replace_module(mlp.experts, SequentialMLP, GroupedExperts)
    if moe and mlp is not None and arch.whole_experts and _submodules(mlp.experts) is not None:
        # an expert adds its output bias in place, which the one-rank reduction's returned view forbids
        experts = _submodules(mlp.experts)
        experts.linear_fc1, experts.linear_fc2 = one_rank_linears()
    if arch.zero_centered_norms:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
        attn.q_layernorm = attn.k_layernorm = ZeroCenteredRMSNorm
    if arch.hc_mult > 1:
        from .hyper import streams_spec

        spec = streams_spec(arch, spec)
    return edit(spec) if edit is not None else spec


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm that scales by ``1 + weight`` (megatron-core's ``layernorm_zero_centered_gamma``,
    which the local spec's torch norm refuses), normalising in fp32 as Qwen3-Next's norm does.
    The stored weight is the checkpoint's own, so conversion copies it unchanged."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


@functools.cache
def _mla_without_te() -> None:
    """megatron-core 0.16's MLA module imports Transformer Engine's classes from its extension,
    which without TE defines them as ``MagicMock`` instances, and then ``isinstance``-checks its
    projection against one (a TypeError). Without TE nothing is a ``TELinear``: a class of that
    meaning replaces the mock (no behaviour of megatron-core changes)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type) and mla.TELinear is not None:
        mla.TELinear = type("NoTransformerEngineLinear", (), {})


def _with_eps(norm: Any, eps: float) -> type:
    """``norm`` built with ``eps`` whatever megatron-core passes (DeepSeek's latent RMSNorms keep
    their own epsilon). A class, as megatron-core's ``build_module`` wants."""
    from megatron.core.transformer.spec_utils import build_module

    class FixedEpsNorm:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return build_module(norm, *args, **{**kwargs, "eps": eps})

    return FixedEpsNorm


def block_spec(arch: Arch, config: Any, edit: Callable[[Any], Any] | None = None, tp: int = 1,
               vp_stage: int | None = None) -> Any:
    """One layer spec for every layer, or, where dense and MoE layers mix (or the final norm is
    zero-centred or collapses hyper-connection streams), the spec of each layer of this pipeline
    stage (or virtual chunk)."""
    if not arch.dense_layers and not arch.zero_centered_norms and arch.hc_mult == 1:
        return layer_spec(arch, edit, tp)
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    kinds = {m: layer_spec(arch, edit, tp, moe=m) for m in {arch.moe_layer(i) for i in range(arch.num_layers)}}
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    norm = ZeroCenteredRMSNorm if arch.zero_centered_norms else LayerNormImpl
    if arch.hc_mult > 1:  # the streams collapse before the final norm
        from .hyper import head_class

        norm = head_class(arch.hc_mult, arch.hc_eps)
    return TransformerBlockSubmodules(layer_specs=[kinds[arch.moe_layer(i)] for i in range(offset, offset + count)],
                                      layer_norm=norm)


def build_gpt(arch: Arch, config: Any, *, tp: int = 1, pre_process: bool = True, post_process: bool = True,
              edit: Callable[[Any], Any] | None = None, tied: bool | None = None,
              vp_stage: int | None = None) -> Any:
    """A megatron-core ``GPTModel`` for ``arch`` (weights uninitialised: load them from HF).
    ``tied``: share the embedding with the output layer (default: as the HF config says);
    ``vp_stage``: the model chunk of this rank, with interleaved (virtual) pipeline stages."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(config, block_spec(arch, config, edit, tp, vp_stage), vocab_size=arch.padded_vocab(tp),
                     max_sequence_length=arch.max_positions, pre_process=pre_process,
                     post_process=post_process,
                     share_embeddings_and_output_weights=arch.tied if tied is None else tied,
                     position_embedding_type="yarn" if arch.yarn_factor > 1 else "rope", rotary_base=arch.rope_theta,
                     rotary_percent=arch.rotary_fraction,
                     **({"vp_stage": vp_stage} if vp_stage is not None else {}))
    if post_process and not config.sequence_parallel:
        batch_major_logits(model.output_layer)
    if arch.moe:
        from .dispatch import dispatch_on_one_rank

        dispatch_on_one_rank(model)
    if arch.hash_layers:
        from .routing import share_token_ids

        share_token_ids(model)
    if config.tensor_model_parallel_size > 1:
        from .tp_train import unsplit_tokens

        unsplit_tokens(model, arch)
    return model


def batch_major_logits(output_layer: torch.nn.Module) -> None:
    """Have the output layer write its logits batch-major. GPTModel returns
    ``logits.transpose(0, 1).contiguous()``: from sequence-major logits that is a copy of the whole
    ``[B, S, V]`` tensor, and its backward copies the gradient back (the largest tensors of a step,
    ~10 GB each at 32 rows x 1,024 tokens of a 152k vocabulary). Fed ``[B, S, H]`` (a copy of the
    much smaller hidden states) and returning a transposed view, the layer's product is already in
    the returned layout and ``contiguous()`` is free. Rows are independent, so the values are
    unchanged. Not with sequence parallelism, whose input is split along the sequence."""
    def batch_major(_module: Any, args: tuple) -> tuple:
        return (args[0].transpose(0, 1).contiguous(), *args[1:])

    def back_to_sequence_major(_module: Any, _args: tuple, out: tuple) -> tuple:
        return (out[0].transpose(0, 1), *out[1:])

    output_layer.register_forward_pre_hook(batch_major)
    output_layer.register_forward_hook(back_to_sequence_major)
