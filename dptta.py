"""dptta: differentially private test-time adaptation. Tent, EATA, SAR, DeYO and COME adapt
a model's normalization layers θ on unlabeled test batches, and θ leaks them; DP-TTA makes
each update private, so θ and every prediction for *other* images can be released.

    g_i = ∇θ ℓ(x_i)                                    one sample's own loss
    Δ   = (Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²I)) / B   clip, sum, noise, average
    θ  ← SGD-momentum(θ, Δ)                             post-processing

    python dptta.py --synthetic 16 --method dp_tent --eps 5     # a smoke run, CPU, ~1 min
    adapter = DPTTA(model, "dp_tent", eps=5, clip=1.0, lr=1e-3)  # as a library
"""
# ============================================================================
# Part I: DP-TTA, one block to copy (torch, numpy, scipy). Part II: ImageNet-C; Appendix: tools
import contextlib
import math
import os
import re
import warnings
import weakref
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import optimize, special
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

def need(ok, problem):  # an argument check: raises, in one line
    if not ok:
        raise ValueError(problem)

# -- Privacy accounting: one pass, μ-GDP with μ = 2/σ ------------------------
EPS_MAX = 1e6  # σ ≈ 1e-3: beyond it the accountant's root finder loses its footing

def _check_privacy(eps=None, delta=None, sigma=None):  # NaN: refused
    need(eps is None or eps > 0, f"eps must be > 0 (inf: no noise), got {eps}")
    need(eps is None or eps <= EPS_MAX or math.isinf(eps),
         f"eps must be <= {EPS_MAX:g} or inf (no noise), got {eps}")
    need(delta is None or 0 < delta < 1, f"delta must be in (0, 1), got {delta}")
    need(sigma is None or sigma >= 0, f"sigma must be >= 0, got {sigma}")

def _log_gdp_delta(eps, sigma):
    # δ = Φ(x) − e^ε Φ(x − μ), x = −ε/μ + μ/2, in logs: log δ = log Φ(x) + log(1 − e^−D) with
    # D = log Φ(x) − ε − log Φ(x − μ) > 0, so no Φ underflows (large ε, small δ)
    mu = 2 / sigma
    x = -eps / mu + mu / 2
    log_phi = special.log_ndtr(x)
    D = log_phi - eps - special.log_ndtr(x - mu)
    # near cancellation (large σ): D = ∫_{x−μ}^{x} (φ/Φ(u) + u) du
    if D < 0.1:
        nodes, weights = np.polynomial.legendre.leggauss(16)  # exact to rounding
        u = x - mu / 2 + nodes * mu / 2
        hazard = np.exp(-u ** 2 / 2 - math.log(2 * math.pi) / 2 - special.log_ndtr(u))
        D = mu / 2 * np.sum(weights * (hazard + u))
    # rounding, only at Φ(x) < 1e-300: δ <= Φ(x), the safe side
    if not D > 0:
        return log_phi
    return log_phi + np.log(-np.expm1(-D))

def gdp_delta(*, eps, sigma):
    """δ(ε) = Φ(−σε/2 + 1/σ) − e^ε Φ(−σε/2 − 1/σ): a sum of sensitivity 2C
    with noise σC is (2/σ)-GDP (Dong, Roth & Su 2022, Cor. 2.13)."""
    _check_privacy(eps=eps, sigma=sigma)
    if sigma == 0:
        return 1.0
    if math.isinf(eps) or math.isinf(sigma):
        return 0.0
    return float(np.exp(_log_gdp_delta(eps, sigma)))

def _root(f, lo, hi):
    """The smallest x with f(x) <= 0, f decreasing; never a hair short."""
    while f(lo) < 0:
        lo /= 2
    while f(hi) > 0:
        hi *= 2
    x = optimize.brentq(f, lo, hi, xtol=1e-300, rtol=1e-12)
    while f(x) > 0:
        x *= 1 + 1e-10
    return float(x)

def calibrate_sigma(*, eps, delta, repeats=1):
    """The smallest σ with gdp_delta(eps, σ/√k) <= delta, k = repeats: k
    (2/σ)-GDP releases are (2√k/σ)-GDP (ibid., Cor. 3.3). eps = inf: 0."""
    _check_privacy(eps=eps, delta=delta)
    if math.isinf(eps):
        return 0.0
    # f = δ(σ)/δ − 1, computed as gdp_delta computes it: exactly <= delta
    sigma = _root(lambda s: np.exp(_log_gdp_delta(eps, s)) / delta - 1, 0.1, 1.0)
    return sigma * math.sqrt(repeats)

def gdp_epsilon(*, sigma, delta):
    """The smallest ε with gdp_delta(ε, sigma) <= delta; inf for σ = 0."""
    _check_privacy(delta=delta, sigma=sigma)
    if sigma == 0:
        return math.inf
    if _log_gdp_delta(0.0, sigma) <= math.log(delta):
        return 0.0
    return _root(lambda e: np.exp(_log_gdp_delta(e, sigma)) / delta - 1, 0.0, 1.0)

# -- Per-sample gradients, clipping and noise --------------------------------
BATCH_NORM = nn.modules.batchnorm._BatchNorm  # timm's BatchNormAct2d too
# the adaptable norm layers (their subclasses too: timm's LayerNorm2d, GroupNorm1, BatchNormAct2d);
# timm's own RmsNorm and SimpleNorm subclass none of these: add them here to adapt them
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.instancenorm._InstanceNorm,
         BATCH_NORM)

def couples_samples(m):
    """A BatchNorm that normalizes with the batch: in train mode, or with no running statistics
    (track_running_stats=False: the batch even in eval mode)."""
    return isinstance(m, BATCH_NORM) and (m.training or m.running_mean is None)
VMAP_FALLBACKS = {}  # op -> passes that ran it once per sample

def _trunk_cut(model):
    """Where the trunk's top starts; SAR and DeYO adapt the norms registered before it.
    The trunk is the first container (Sequential, ModuleList) named
    - blocks (timm ViT, DeiT, BEiT, EVA, CaiT, XCiT) or layer (Hugging Face ViT): its last
      3 are the top (ViT-B/16: blocks 0-8 adapted, as SAR and DeYO do);
    - layers: the last 3 of 6 or more blocks (torchvision ViT), else its last stage (timm
      and Hugging Face Swin);
    - stages (ConvNeXt, PVT, EdgeNeXt, MobileViT, Hugging Face ResNet) or features
      (torchvision ConvNeXt, Swin): its last stage;
    or ResNet's layer1..layerN: the last, as the originals' ResNets. None otherwise: all
    norms are adapted."""
    layers = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        trunk = leaf in ("blocks", "layer", "layers", "stages", "features")
        if trunk and isinstance(module, (nn.Sequential, nn.ModuleList)):
            top = 1
            if leaf in ("blocks", "layer") or (leaf == "layers" and len(module) >= 6):
                top = 3
            if len(module) > top:  # (a Sequential built from a dict names its items)
                return f"{name}.{list(module._modules)[len(module) - top]}"
        if re.fullmatch(r"layer\d+", leaf) and isinstance(module, nn.Sequential):
            layers.append((int(leaf[5:]), name))
    if len(layers) > 1:
        return max(layers)[1]
    return None

def adaptable_params(model, *, skip_top=False, private=True):
    """{name: a norm layer's affine parameter}; skip_top (SAR, DeYO): below
    the top only (ViT-B/16: blocks 0-8); private: BatchNorm refused."""
    bn = [n for n, m in model.named_modules() if isinstance(m, BATCH_NORM)][:1]
    need(not (private and bn), f"BatchNorm ({', '.join(bn)}, ...) mixes the samples of a "
         'batch: no per-sample gradients (dp_, clip); bn="source" keeps its statistics')
    cut, params, seen = skip_top and _trunk_cut(model), {}, set()
    for name, m in model.named_modules():
        if name == cut:
            break
        if isinstance(m, NORMS):
            for k, p in m.named_parameters(recurse=False):
                if id(p) not in seen:  # a tensor tied to two modules: adapted once
                    seen.add(id(p))
                    params[f"{name}.{k}"] = p
    need(params, "the model has no norm-layer affine parameters to adapt")
    return params

def per_sample_grads(model, params, loss_fn, x, ctx=None, *, chunk_size=None):
    """({name: g [B, *shape]}, logits), g_i = ∇θ loss_fn(f_θ(x_i), ctx_i);
    loss_fn: (logits [N, K], ctx [N, ...] or None) -> [N]. x_i gets its own
    view θ_i of θ, a vmapped forward; ONE backward of Σ_j ℓ_j gives each θ_i
    its g_i (vmap(grad) would loop: fused attention's backward has no rule)."""
    coupled = [n for n, m in model.named_modules() if couples_samples(m)]
    need(not coupled, f"BatchNorm {', '.join(coupled)} in train mode or without running "
         "statistics: no per-sample gradients")
    frozen = {n: t.detach() for n, t in model.named_parameters() if n not in params}
    frozen.update(model.named_buffers())

    def loss_one(theta_i, xi, ci):  # under vmap: one sample, its own θ_i
        logits = logits_of(functional_call(model, (theta_i, frozen), (xi[None],)))
        return loss_fn(logits, None if ctx is None else ci[None])[0], logits[0]

    def batched_pass():  # GPU: the batch; CPU: 8 (ViT-S: 0.96x Tent, 32: 1.42x)
        grads, logits, step = [], [], chunk_size or {"cpu": 8}.get(x.device.type, len(x))
        ctxs = x.new_zeros(len(x), 0) if ctx is None else ctx  # vmap needs one
        for xs, cs in zip(x.split(step), ctxs.split(step)):
            # [b, *shape] views of θ: 38k scalars a sample for ViT-B/16, nothing copied
            theta = {n: p.detach().expand(len(xs), *p.shape).requires_grad_()
                     for n, p in params.items()}
            losses, z = vmap(loss_one)(theta, xs, cs)
            grads.append(torch.autograd.grad(
                losses.sum(), list(theta.values()), materialize_grads=True))
            logits.append(z.detach())
        return {n: torch.cat(g) for n, g in zip(params, zip(*grads))}, torch.cat(logits)

    with contextlib.ExitStack() as stack:  # ops with no vmap rule: exact swaps
        if x.device.type == "cpu":  # fused attention (CUDA's kernels batch)
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        mha = torch.backends.mha  # nn.MultiheadAttention's eval path: no grad
        stack.callback(mha.set_fastpath_enabled, mha.get_fastpath_enabled())
        mha.set_fastpath_enabled(False)
        for m in model.modules():  # adaptive pooling's as_strided_
            if isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)):
                stack.enter_context(m.register_forward_pre_hook(lambda _, a: a[0].contiguous()))
        return _without_fallback(batched_pass)

def logits_of(out):
    """Logits [B, K]: the output, its .logits or ["logits"] (Hugging Face)."""
    z = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", out)
    if not isinstance(z, torch.Tensor):
        raise TypeError(f"the model returned a {type(out).__name__}; DPTTA needs logits "
                        "[B, K]: a tensor, .logits or ['logits']")
    return z

def _without_fallback(fn):
    """fn() with vmap's per-sample fallback an error; an op that needs it is
    warned about, counted and rerun with it (exact, slow) unless the caller
    had it off. A torch without this private switch runs fn(), and says so."""
    functorch = getattr(torch._C, "_functorch", None)
    if not hasattr(functorch, "_set_vmap_fallback_enabled"):
        warnings.warn("this torch cannot switch vmap's fallback off: no loop certified")
        return fn()
    allowed = functorch._is_vmap_fallback_enabled()
    functorch._set_vmap_fallback_enabled(False)
    try:
        return fn()
    except RuntimeError as e:
        op = re.search(r"(\S+) hit the vmap fallback", str(e))
        if not (op and allowed):
            raise
    finally:
        functorch._set_vmap_fallback_enabled(allowed)
    if op[1] not in VMAP_FALLBACKS:
        warnings.warn(f"{op[1]} has no vmap rule: it runs once per sample (exact, slow); "
                      "timm: fused_attn=False", stacklevel=3)
    VMAP_FALLBACKS[op[1]] = VMAP_FALLBACKS.get(op[1], 0) + 1
    return fn()

def noise_generator(device="cpu", seed=None):
    """The privacy noise's source: seeded from OS entropy (secret: a known seed lets anyone
    regenerate the noise and subtract it), or from `seed` for an exact, NOT private replay."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    return torch.Generator(device).manual_seed(seed)

def at_least_fp32(t):  # bf16/fp16 -> fp32; fp32, fp64 kept
    return t.to(torch.promote_types(t.dtype, torch.float32))

def clip_and_noise(per_sample_grads, clip, sigma, generator, tally=None):
    """Δ = (Σ_i g_i·min(1, C/‖g_i‖) + N(0, σ²C²I)) / B, sensitivity 2C, one
    ‖·‖ over all tensors, fp32 or better (bf16 can push a norm over C); a
    non-finite g_i counts as 0 (decided on i alone) and in tally["nonfinite"]."""
    g = {n: at_least_fp32(t) for n, t in per_sample_grads.items()}
    norms = torch.stack([t.flatten(1).pow(2).sum(1) for t in g.values()]).sum(0).sqrt()
    finite = torch.isfinite(norms)
    factor = (clip / norms.clamp(min=1e-12)).clamp(max=1.0)  # min(1, C/‖g_i‖)
    if tally is not None:
        tally["nonfinite"] = tally.get("nonfinite", 0) + (~finite).sum()
    out = {}
    for name, t in g.items():
        shape = (-1,) + (1,) * (t.dim() - 1)  # a [B] vector broadcast over t
        # a non-finite g_i is selected away, not scaled by 0: NaN·0 is NaN
        total = torch.where(finite.view(shape), factor.view(shape) * t, 0.0).sum(0)
        if sigma > 0:  # fresh N(0, σ²C²) for every coordinate
            noise = torch.empty_like(total).normal_(generator=generator)
            total = total + sigma * clip * noise
        out[name] = total / len(t)  # / B
    return out

# -- Losses: per sample, logits [N, K] -> [N] --------------------------------
# K: classes, of the logits or num_classes (the paper's ImageNet-R runs: 200 scored, K = 1000)
def entropy(logits):
    # H(p) = −Σ_k p_k log p_k, p = softmax(z)
    logp = at_least_fp32(logits).log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)

def come_entropy(logits, num_classes=None):
    """COME: entropy of the Dirichlet opinion [b, u] instead of the softmax."""
    z = at_least_fp32(logits)
    # z ← z/‖z‖·stopgrad(‖z‖): same value, no gradient along z (no logit-norm inflation)
    norm = z.norm(dim=-1, keepdim=True)
    z = z / norm.clamp(min=1e-12) * norm.detach()  # zero logits: 0, not NaN
    # b = e^z / (Σ e^z + K), u = K / (Σ e^z + K)  ⇔  [b, u] = softmax([z, ln K])
    log_k = torch.full_like(z[..., :1], math.log(num_classes or z.shape[-1]))
    q = torch.cat([z, log_k], -1).softmax(-1) + 1e-7
    return -(q * q.log()).sum(-1)  # −Σ_{j=1}^{K+1} q_j log q_j

def plpd(logits, shuffled_probs):
    # PLPD = p(ŷ|x) − p(ŷ|x′), ŷ = argmax p(·|x): how much a prediction rests on shape
    p = at_least_fp32(logits).softmax(-1)
    y = p.argmax(-1, keepdim=True)
    return (p.gather(-1, y) - shuffled_probs.gather(-1, y)).squeeze(-1).detach()

def confidence_weighted(
        logits, shuffled_probs=None, *, ent=entropy, e_margin=0.4, num_classes=None):
    """EATA: exp(E0 − H)·H; DeYO (shuffled probs): (exp(E0 − H) + e^PLPD)·H."""
    H = ent(logits)
    # w = exp(E0 − H), E0 = e_margin·ln K, a constant weight (detached)
    w = torch.exp(e_margin * math.log(num_classes or logits.shape[-1]) - H.detach())
    if shuffled_probs is not None:
        w = w + torch.exp(plpd(logits, shuffled_probs))
    return w * H

def patch_shuffle(x, grid, generator):
    """x′: each image's grid×grid patches in an order of its own (the rest stays)."""
    h, w = x.shape[-2] // grid, x.shape[-1] // grid  # one patch
    H, W = h * grid, w * grid  # the part cut into patches
    patches = F.unfold(x[..., :H, :W], (h, w), stride=(h, w))  # [B, ch·h·w, grid²]
    perm = torch.rand(len(x), grid * grid, generator=generator, device=x.device).argsort(1)
    patches = patches.gather(2, perm[:, None].expand_as(patches))  # patch j ← patch perm_j
    out = x.clone()
    out[..., :H, :W] = F.fold(patches, (H, W), (h, w), stride=(h, w))
    return out

def bn_moments(x, mean, var, eps):
    """dp_norm's v_i of BN's input x [B, C, ...]: (mean z, mean z² − 1), z =
    (x − μ_src)/√(var_src + eps); 0 at the source: a clip shrinks toward it."""
    z = at_least_fp32(x.reshape(*x.shape[:2], -1))  # [B, C, H·W] (BN1d: H·W = 1)
    z = (z - mean[:, None]) / (var[:, None] + eps).sqrt()
    return torch.cat([z.mean(-1), z.pow(2).mean(-1) - 1], 1)

# -- The methods: H, softmax entropy; H_come, COME's; E0 = e_margin·ln K; lower: below the top --
# method     per-sample loss ℓ_i          original's filter          norms  extra term
# tent       H                            -                          all    -
# come       H_come                       -                          all    -
# eata       exp(E0 − H)·H                H < E0, |cos(m, p)| < d    all    λ·ΣF(θ − θ0)², data-free
# sar        H                            H < E0; reset on collapse  lower  SAM: ascend ρ·g/‖g‖
# deyo       (exp(E0 − H) + e^PLPD)·H     H < deyo_margin·ln K,      lower  x′ = patch shuffle
#                                         PLPD > plpd_threshold             of x, for PLPD
# deyo_come  as deyo, H_come for H        as deyo, with H_come       lower  as deyo
# norm       no loss, no step: every BatchNorm layer normalizes with the test batch's statistics
# dp_norm    no step: each of L BN layers, with an EMA of private releases of its clipped
#            bn_moments, noise σ_l = √L·σ (the L releases compose to (2/σ)-GDP per image)
# dp_<method>: the same ℓ_i, clipped and noised, NO filter (whether sample i counts must not
# depend on sample j, and a kept count is itself data); EATA's penalty is added after the noise
# (it reads θ, θ0 and public F only); SAR ascends along the previous private gradient (DP-SAT,
# for free). <method> with clip=C: filter kept, per-sample clip, no noise (the paper's clip-only).

BASES = ("tent", "come", "eata", "sar", "deyo", "deyo_come")
NORM_METHODS = ("norm", "dp_norm")  # statistics, not gradients
METHODS = ("source",) + BASES + tuple("dp_" + b for b in BASES) + NORM_METHODS
COME_LOSS = ("come", "deyo_come")
WEIGHTED = ("eata", "deyo", "deyo_come")
LOWER_NORMS = ("sar", "deyo", "deyo_come")
SHUFFLED = ("deyo", "deyo_come")

_ADAPTED = weakref.WeakValueDictionary()  # id(parameter) -> its live DPTTA

class DPTTA(nn.Module):
    """forward(x) predicts with θ (logits, detached), then adapts θ on x.
    method: a table row, dp_<row> or "source"; repeats=k: k steps see each
    privacy unit ("image" or "photo", a label), σ·√k; accumulate=k: a step
    per k batches; fisher: EATA's public {name: F}; bn: BatchNorm on the test
    batch's statistics ("train", Tent's; not per-sample) or the source's.
    seed: DeYO's patch shuffles; the noise is secret (OS entropy) unless
    noise_seed is given (an exact replay, NOT private against its holder)."""
    STATE = ("ema", "m", "g_prev", "bn_ema")  # SAR's, EATA's, DP-SAR's, dp_norm's

    def __init__(self, model, method, *, eps=None, delta=1e-6, privacy_unit="image", repeats=1,
                 clip=None, lr=None, seed=0, noise_seed=None, fisher=None, fisher_lambda=2000.0, e_margin=0.4,
                 d_margin=0.05, rho=0.05, reset_ema=0.2, deyo_margin=0.5, plpd_threshold=0.2,
                 patch_grid=4, num_classes=None, bn="train", bn_scale=0.5, bn_momentum=0.1,
                 bn_floor=0.1, bn_layers=None, accumulate=1, chunk_size=None):
        super().__init__()  # the arguments, checked in this order:
        need(method in METHODS, f"unknown method {method!r}; one of {', '.join(METHODS)}")
        self.method, self.base = method, method.removeprefix("dp_")  # base: original
        self.private = private = method.startswith("dp_")
        need(eps is None or private, f"eps is for dp_ methods only, not {method}")
        need(eps is not None or not private, f"{method} needs eps (inf: clip only)")
        _check_privacy(eps=eps, delta=delta)
        need(clip is not None or not private or method == "dp_norm",
             f"{method} needs clip, the per-sample clip norm C")
        need(clip is None or 0 < clip < math.inf,
             f"clip must be finite and > 0 (None: no clip), got {clip}")
        need(self.base in ("source", "norm") or 0 < (lr or 0) < math.inf,
             f"{method} needs a finite lr > 0, got {lr}")
        need(privacy_unit in ("image", "photo"), "privacy_unit is 'image' or 'photo'")
        need(isinstance(repeats, int) and repeats >= 1, "repeats must be an int >= 1")
        need(bn in ("train", "source"), "bn is 'train' or 'source'")
        need(isinstance(accumulate, int) and accumulate >= 1, "accumulate must be an int >= 1")
        need(noise_seed is None or isinstance(noise_seed, int), "noise_seed is an int or None")
        need(accumulate == 1 or method != "norm", "norm has nothing to accumulate")
        self.eps, self.delta, self.privacy_unit, self.repeats = eps, delta, privacy_unit, repeats
        self.sigma = calibrate_sigma(eps=eps or math.inf, delta=delta, repeats=repeats)
        self.clip, self.lr = clip and float(clip), lr and float(lr)
        self.bn, self.accumulate, self.fisher = bn, accumulate, fisher
        self.hp = dict(
            e_margin=e_margin, d_margin=d_margin, rho=rho, reset_ema=reset_ema,
            deyo_margin=deyo_margin, plpd_threshold=plpd_threshold, patch_grid=patch_grid,
            fisher_lambda=fisher_lambda, num_classes=num_classes, bn_scale=bn_scale,
            bn_momentum=bn_momentum, bn_floor=bn_floor)
        self.ent = entropy
        if self.base in COME_LOSS:
            self.ent = partial(come_entropy, num_classes=num_classes)
        self.model = model.eval().requires_grad_(False)  # eval: nothing random
        self.releases, self.bn_src = 1, {}  # per image: a step, or dp_norm's L
        self.params = self.model_params = {}  # θ (source, norm: none)
        bns = [(n, m) for n, m in model.named_modules() if isinstance(m, BATCH_NORM)]
        frozen = [n for n, m in bns if m.running_mean is None]
        need(not frozen or (bn == "train" and method != "dp_norm"),
             f"BatchNorm {frozen[:1]} has no running statistics (track_running_stats=False): it "
             "normalizes with the batch even in eval mode, so it has no source statistics to "
             "keep (bn='source') or re-estimate (dp_norm)")
        if self.base == "norm":  # dp_norm: the first bn_layers, σ·√L
            need(bns and bn == "train", f"{method} re-estimates BatchNorm statistics: it "
                 "needs a model with BatchNorm, not frozen at its source statistics")
            need(bn_layers is None or isinstance(bn_layers, int) and 1 <= bn_layers <= len(bns),
                 f"bn_layers must be a count from 1 to the model's {len(bns)} BatchNorm layers "
                 f"(None: all), got {bn_layers}")
            if private:
                self.bn_src = {n: (m.running_mean.clone(), m.running_var.clone())
                               for n, m in bns[:bn_layers]}
                self.releases = len(self.bn_src)
                self.sigma *= math.sqrt(self.releases)
        elif self.base != "source":
            self.model_params = adaptable_params(model, skip_top=self.base in LOWER_NORMS,
                                                 private=clip is not None and bn == "train")
            # θ: fp32 masters of bf16/fp16 parameters (bf16 rounds an update < 2^-8 at 1 away)
            self.params = {n: at_least_fp32(p).requires_grad_()
                           for n, p in self.model_params.items()}
        need(fisher is None or set(fisher) == set(self.params),
             "fisher must have one tensor per adapted parameter (see .params)")
        if self.base != "source":  # source only predicts: claims, switches nothing
            self._claim()
            for m in model.modules():  # bn="train", as Tent: BatchNorm
                if isinstance(m, BATCH_NORM) and bn == "train" and not self.bn_src:
                    m.train()  # normalizes with the test batch's statistics
                    m.track_running_stats = False
        device, self.chunk_size = next(model.parameters()).device, chunk_size
        # own streams, never rewound by reset(): the same noise twice could cancel out
        self.noise_seed, self.noise_gen = noise_seed, noise_generator(device, noise_seed)
        self.shuffle_gen = torch.Generator(device).manual_seed(seed)
        self.bn_checked = not self.bn_src  # dp_norm: releases per forward not yet counted
        self.theta0 = {n: p.detach().clone() for n, p in self.params.items()}
        self.tally = {}  # "nonfinite": samples dropped for a non-finite g_i
        self.reset()

    def _claim(self):  # one live adapter per model (two would share θ)
        taken = [n for n, p in self.model.named_parameters() if id(p) in _ADAPTED]
        need(not taken, f"{', '.join(taken[:1])} is adapted by another live DPTTA: pass "
             "copy.deepcopy(model), or del the other")
        _ADAPTED.update({id(p): self for p in self.model.parameters()})

    def __getstate__(self):
        """copy, pickle: refused with a pending accumulate window (a copy would step on its
        images too, a pickle would write them to disk)."""
        self._no_window("a copy")
        return super().__getstate__()

    def _no_window(self, what):
        need(not self.window, f"{what} of an adapter with {len(self.window)} pending "
             "accumulate batch(es) would hold raw test images: flush() first")

    def __setstate__(self, state):
        """copy, pickle: the copy reseeds from the OS (no shared noise)."""
        super().__setstate__(state)
        if self.base != "source":
            self._claim()
        for g in (self.noise_gen, self.shuffle_gen):
            g.manual_seed(int.from_bytes(os.urandom(8), "little"))

    def get_extra_state(self):
        """In state_dict(): exact resume, noise where it stood (load it once). It holds the
        noise generator's state: a checkpoint is as secret as the test data."""
        self._no_window("a checkpoint")
        return dict(
            method=self.method, sigma=self.sigma, theta=dict(self.params), theta0=self.theta0,
            opt=self.opt and self.opt.state_dict(), noise=self.noise_gen.get_state(),
            shuffle=self.shuffle_gen.get_state(), **{k: getattr(self, k) for k in self.STATE})

    def set_extra_state(self, state):
        old = state["method"], state["sigma"]
        need(old == (self.method, self.sigma), f"a checkpoint of {old[0]} (σ = {old[1]:.4g}) "
             f"cannot resume {self.method} (σ = {self.sigma:.4g})")
        self._set_theta(state["theta"], state["theta0"])
        if self.opt:
            self.opt.load_state_dict(state["opt"])
        for k in self.STATE:
            setattr(self, k, state[k])
        self.noise_gen.set_state(state["noise"])
        self.shuffle_gen.set_state(state["shuffle"])

    def reset(self):
        """Back to the source: θ, optimizer, method state (not the RNGs)."""
        self._set_theta(self.theta0)
        self.opt = self.params and torch.optim.SGD(self.params.values(), lr=self.lr, momentum=0.9)
        self.ema = self.m = self.g_prev = None
        self.window = []  # accumulate's batches; a reset drops them unstepped
        # dp_norm: the average of the releases in z-space, from the source's (0, 1)
        self.bn_ema = {n: (0 * m, 0 * m + 1) for n, (m, _) in self.bn_src.items()}
        for bn, (mean, var) in self.bn_src.items():
            self.model.get_submodule(bn).running_mean.copy_(mean)
            self.model.get_submodule(bn).running_var.copy_(var)

    @torch.no_grad()
    def _set_theta(self, values, theta0=None):  # θ ← values; a bf16 model: rounded
        for n, p in self.params.items():
            p.copy_(values[n])
            self.model_params[n].copy_(p)  # p itself in an fp32 model: a no-op
            if theta0 is not None:
                self.theta0[n].copy_(theta0[n])

    # -- the few places where methods differ besides ℓ_i ----------------------
    def loss(self, logits, ctx):
        """ℓ_i, the per-sample loss whose gradient is clipped (the table's)."""
        if self.base not in WEIGHTED:
            return self.ent(logits)
        return confidence_weighted(logits, ctx, ent=self.ent, e_margin=self.hp["e_margin"],
                                   num_classes=self.hp["num_classes"])

    def _keep(self, logits, ctx, keep):  # the original's filter, & keep
        if self.private or self.base in ("tent", "come"):
            return keep
        margin = self.hp["deyo_margin" if self.base in SHUFFLED else "e_margin"]
        log_k = math.log(self.hp["num_classes"] or logits.shape[-1])
        new = self.ent(logits.detach()) < margin * log_k  # reliable: H < margin·ln K
        if self.base in SHUFFLED:
            new &= plpd(logits, ctx) > self.hp["plpd_threshold"]
        if self.base == "eata":  # redundancy: skip samples like recent ones
            p = logits.detach().float().softmax(-1)
            if self.m is not None:  # |cos(m, p)| < d
                new &= torch.cosine_similarity(self.m[None], p, 1).abs() < self.hp["d_margin"]
            if new.any():  # m ← 0.9·m + 0.1·mean(p of kept)
                mean = p[new].mean(0)
                self.m = mean if self.m is None else 0.9 * self.m + 0.1 * mean
        return new if keep is None else keep & new

    @torch.no_grad()
    def context(self, x):
        """ℓ_i's input besides logits: DeYO's softmax of x′, or None."""
        if self.base not in SHUFFLED:
            return None
        xs = patch_shuffle(x, self.hp["patch_grid"], self.shuffle_gen)
        return logits_of(self.model(xs)).float().softmax(-1)

    # -- the gradient: private (per sample, clipped, noised) or plain ----------
    def _grad(self, x, ctx, shift=None, keep=None, clip=True):  # (logits, Δ, kept)
        theta = {n: (t + shift[n] if shift else t).detach() for n, t in self.params.items()}
        theta = {n: t.to(self.model_params[n].dtype).requires_grad_() for n, t in theta.items()}
        if self.clip is not None and clip:
            return self._private_grad(theta, x, ctx, keep)
        return self._plain_grad(theta, x, ctx, keep)

    def _private_grad(self, theta, x, ctx, keep):
        # Δ = (Σ_i clip(g_i) + N(0, σ²C²I)) / B over the kept samples (dp_: all of them)
        g, logits = per_sample_grads(
            self.model, theta, self.loss, x, ctx, chunk_size=self.chunk_size)
        keep = self._keep(logits, ctx, keep)
        if keep is not None:  # clip-only originals: B is data dependent
            if not keep.any():
                return logits, None, keep
            g = {n: t[keep] for n, t in g.items()}
        return logits, clip_and_noise(g, self.clip, self.sigma, self.noise_gen, self.tally), keep

    def _plain_grad(self, theta, x, ctx, keep):
        # Δ = ∇ mean_kept ℓ_i: plain TTA, one batched backward
        logits = logits_of(functional_call(self.model, theta, (x,)))
        keep = self._keep(logits, ctx, keep)
        z, use, ctx, keep = self._guard_nonfinite(theta, logits, x, ctx, keep)
        if keep is not None and not keep.any():
            return logits, None, keep
        g = torch.autograd.grad(self.loss(z, ctx)[use].mean(), list(theta.values()))
        return logits, {n: at_least_fp32(t) for n, t in zip(theta, g)}, keep

    def _guard_nonfinite(self, theta, logits, x, ctx, keep):
        """Guard: non-finite samples (0·NaN = NaN in backward) dropped, counted; the rest re-run."""
        finite = torch.isfinite(logits).all(-1)
        use = finite if keep is None else keep & finite  # what the loss averages
        if finite.all():
            return logits, use, ctx, keep
        self.tally["nonfinite"] = self.tally.get("nonfinite", 0) + (~finite).sum()
        if not use.any():
            return logits, use, ctx, use
        z = logits_of(functional_call(self.model, theta, (x[finite],)))
        return z, use[finite], None if ctx is None else ctx[finite], use

    def forward(self, x):
        if self.base == "source" or not len(x):  # guard: an empty batch
            with torch.no_grad():
                return logits_of(self.model(x))
        if self.accumulate == 1:
            return self._update(x)
        # accumulate=k: predict with θ, step once k batches have come: θ is fixed in a window, so
        # it is one step on k·B images (one noise draw; k steps of B: √k times the noise)
        if self.window:  # torch.cat of the window at the step needs one image shape
            first = self.window[0]
            need((x.shape[1:], x.dtype, x.device) == (first.shape[1:], first.dtype, first.device),
                 f"a batch of {tuple(x.shape[1:])} {x.dtype} images in a window of "
                 f"{tuple(first.shape[1:])} {first.dtype}: one window, one image shape")
        with torch.no_grad():
            logits = logits_of(self.model(x))
        self.window.append(x)
        if len(self.window) == self.accumulate:
            self.flush()
        return logits

    def flush(self):
        """A step on the window's batches: call it when a stream ends."""
        if self.window:
            x, self.window = torch.cat(self.window), []
            self._update(x)

    def _update(self, x):
        if self.base == "norm":  # no step (dp_norm: statistics released)
            if not self.bn_checked:  # before the first release: one release per layer?
                self.check_releases(torch.zeros_like(x[:1]))
            with torch.no_grad(), contextlib.ExitStack() as hooks:
                for name in self.bn_src:  # a hook's handle removes it on exit
                    hooks.enter_context(self.model.get_submodule(name).register_forward_pre_hook(
                        partial(self._release_stats, name)))
                return logits_of(self.model(x))
        with torch.inference_mode(False), torch.enable_grad():  # guard: no_grad callers
            x = x.clone() if x.is_inference() else x
            if self.base == "sar":
                sam = self._dp_sat_step if self.private else self._sam_step
                return sam(x, self.context(x)).detach()
            logits, g, _ = self._grad(x, self.context(x))  # the others: Δ at θ, SGD
            if g is not None:  # None: the filters kept no sample, no step
                self._step(g)
            return logits.detach()

    def _sam_step(self, x, ctx):
        # SAR: ascend along the plain mean gradient (clip-only too, as the paper), take the
        # gradient at θ + ρ·g/‖g‖ on the samples still kept there, step from θ; then recovery
        logits, g, keep = self._grad(x, ctx, clip=False)
        if g is None:
            return logits
        logits_at_ascent, g, keep = self._grad(x, ctx, self._ascent(g), keep)
        if g is None:
            return logits
        self._step(g)
        # recovery: ema ← 0.9·ema + 0.1·H; a collapse (ema < reset_ema) resets θ, optimizer
        loss = self.ent(logits_at_ascent.detach())[keep].mean().item()
        if not math.isnan(loss):
            self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        if self.ema is not None and self.ema < self.hp["reset_ema"]:
            self.reset()
        return logits

    def _dp_sat_step(self, x, ctx):  # DP-SAT: ascend along the last *private* Δ
        shift = None if self.g_prev is None else self._ascent(self.g_prev)
        logits, self.g_prev, _ = self._grad(x, ctx, shift)
        if shift is not None:
            with torch.no_grad():
                logits = logits_of(self.model(x))
        self._step(self.g_prev)
        return logits

    def _ascent(self, g):  # SAM's perturbation ρ·g/‖g‖
        norm = torch.stack([t.pow(2).sum() for t in g.values()]).sum().sqrt()
        return {n: self.hp["rho"] * t / norm.clamp(min=1e-12) for n, t in g.items()}

    def check_releases(self, x):
        """dp_norm accounts one release per private BN layer and forward: a module run twice
        (shared, or a block applied twice) would release twice. A data-free forward (zeros of
        the input's shape) counts the calls; a layer called more than once is refused."""
        calls = dict.fromkeys(self.bn_src, 0)

        def count(name, module, args):
            calls[name] += 1

        with torch.no_grad(), contextlib.ExitStack() as hooks:
            for name in self.bn_src:
                module = self.model.get_submodule(name)
                hooks.enter_context(module.register_forward_pre_hook(partial(count, name)))
            self.model(x)
        twice = [f"{n} ({k}x)" for n, k in calls.items() if k > 1]
        need(not twice, f"BatchNorm {', '.join(twice)} runs more than once per forward: each "
             "run would be a release that dp_norm does not account; give each use its own module")
        self.bn_checked = True

    def _release_stats(self, name, bn, args):
        """dp_norm, before BN `name` runs: its statistics := its releases."""
        mean, var = self.bn_src[name]
        v = bn_moments(args[0], mean, var, bn.eps)
        # (Σ_i clip(v_i, c) + N(0, σ_l²c²I)) / B, c = scale·√(2C): a (2/σ_l)-GDP release
        c = self.hp["bn_scale"] * math.sqrt(v.shape[1])
        s = clip_and_noise({"v": v}, c, self.sigma, self.noise_gen)["v"]
        m, v = s[:len(mean)], s[len(mean):] + 1 - s[:len(mean)] ** 2  # E z, E[z²] − (E z)²
        k, (m0, v0) = self.hp["bn_momentum"], self.bn_ema[name]  # EMA: ← (1 − k)·old + k·new
        m, v = (1 - k) * m0 + k * m, ((1 - k) * v0 + k * v).clamp(min=self.hp["bn_floor"])
        self.bn_ema[name] = m, v
        bn.running_mean.copy_(mean + (var + bn.eps).sqrt() * m)  # μ = μ_src + σ_src·E z
        bn.running_var.copy_((var + bn.eps) * v)  # σ_src²·var z, as train mode

    def _step(self, g):
        for n, p in self.params.items():
            if self.fisher is not None:  # data-free (θ, θ0, public F): unclipped
                drift = p.detach() - self.theta0[n]  # ∇ λ·Σ F(θ − θ0)² = 2λF(θ − θ0)
                g[n] = g[n] + 2 * self.hp["fisher_lambda"] * self.fisher[n] * drift
            p.grad = g[n].to(p.dtype)
        self.opt.step()
        self._set_theta(self.params)

# ============================================================================
# Part II: running it (data, the paper's hyperparameters, the command line, main)
import argparse
import copy
import hashlib
import json
import signal
import stat
import sys
import tempfile
import time
import uuid

import timm
from PIL import Image
from torch.utils.data import DataLoader, Subset, default_collate
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import has_file_allowed_extension

# -- Data: ImageNet-C / ImageNet-R folders, labelled by WordNet id -----------
CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
               "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
               "elastic_transform", "pixelate", "jpeg_compression")
HELD_OUT = ("speckle_noise", "gaussian_blur", "spatter", "saturate")  # for tuning
LAYOUT = ("expected ROOT/<corruption>/<severity>/<wnid>/*.JPEG (ImageNet-R: "
          "ROOT/<wnid>/*.jpg); ImageNet-C: https://zenodo.org/record/2235448")

def reached_once(seen, path, node):
    """Refuses a path whose node (device, inode) `seen` holds under another path."""
    first = seen.setdefault(node, path)
    need(first == path, f"{path} is {first} again (a link?): an image is in a stream once")

def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()

def check_public(fisher_set, streams, used):
    """EATA's penalty is data-free only if its images are public: a Fisher image that is a
    stream's file (the same device and inode: a link, the same folder) or a byte copy of one
    (compared for the `used` images, against stream files of the same size) is refused."""
    nodes, by_size = {}, {}
    for ds in streams.values():
        nodes.update(ds.nodes)
        for path, size in ds.sizes.items():
            by_size.setdefault(size, []).append(path)
    for node, path in fisher_set.nodes.items():
        require(node not in nodes, f"--fisher-data: {path} is the stream's {nodes.get(node)}; "
                "EATA's Fisher images must be public, never the test stream")
    for i in used:
        path = fisher_set.samples[i][0]
        same_size = by_size.get(fisher_set.sizes[path], [])
        digest = file_digest(path) if same_size else None
        same = [p for p in same_size if file_digest(p) == digest]
        require(not same, f"--fisher-data: {path} is a copy of the stream's {same[:1]}; EATA's "
                "Fisher images must be public, never the test stream")

def load_rgb(path):
    """PIL's RGB image; 16-bit greyscale (I;16) scaled to 8 bits (PIL's convert clips it at
    255: 99.7% white); 32-bit integer or float images refused (unreadable, named)."""
    with Image.open(path) as img:
        if img.mode.startswith("I;16"):
            pixels = np.asarray(img, dtype=np.float64) / 257  # 65535 -> 255
            return Image.fromarray(pixels.round().astype(np.uint8)).convert("RGB")
        if img.mode in ("I", "F"):
            raise ValueError(f"a {img.mode}-mode (32-bit) image: convert it to 8 bits")
        return img.convert("RGB")

class WnidFolder(ImageFolder):
    """ImageFolder, ImageNet-1k targets by wnid (any subset); unreadable: (None, path).
    Hidden files and folders (a leading '.': macOS' ._ twins, .DS_Store,
    .ipynb_checkpoints) are skipped, and so are files that are not regular (a FIFO would
    hang the loader); a folder inside a class folder is refused (its images would take the
    class's label)."""

    def __init__(self, root, transform=None):
        super().__init__(root, transform)  # raises: no class folder, an empty one
        index = {w: i for i, w in enumerate(timm.data.ImageNetInfo().label_names())}
        unknown = [c for c in self.classes if c not in index]
        if unknown:
            raise ValueError(f"{unknown[0]} is not an ImageNet-1k WordNet id")
        self.imagenet_index = [index[c] for c in self.classes]

    def find_classes(self, directory):
        classes = sorted(e.name for e in os.scandir(directory)
                         if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise FileNotFoundError(f"no class folder in {directory}")
        return classes, {c: i for i, c in enumerate(classes)}

    def make_dataset(
            self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        """ImageFolder's listing; a path reached twice (a link, a loop) refused."""
        self.nodes, self.sizes = {}, {}  # {(device, inode): path} for Mixed; {path: bytes}
        samples = []
        for folder in [directory] + [os.path.join(directory, c) for c in sorted(class_to_idx)]:
            st = os.stat(folder)
            reached_once(self.nodes, folder, (st.st_dev, st.st_ino))
            if folder == directory:
                continue
            found = []
            for name in sorted(os.listdir(folder)):
                if name.startswith("."):  # hidden: macOS' ._ twins, .DS_Store, checkpoints
                    continue
                path = os.path.join(folder, name)
                st = os.stat(path)
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    continue  # a FIFO, a socket, a device
                reached_once(self.nodes, path, (st.st_dev, st.st_ino))
                if stat.S_ISDIR(st.st_mode):
                    raise ValueError(f"{path} is a folder inside a class folder")
                if has_file_allowed_extension(path, extensions):
                    found.append(path)
                    self.sizes[path] = st.st_size
            if not found and not allow_empty:
                raise FileNotFoundError(f"no image in class folder {folder}")
            samples += [(path, class_to_idx[os.path.basename(folder)]) for path in found]
        return samples

    def __getitem__(self, i):
        path, c = self.samples[i]
        try:
            return self.transform(load_rgb(path)), self.imagenet_index[c]
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            return None, path  # truncated, corrupt, not an image, a bomb

def collate_skipping(batch):
    """(x, y, unreadable paths): an unreadable image is a gray placeholder,
    label −1: not scored, but in B (B never depends on a file's health)."""
    bad = [path for x, path in batch if x is None]
    good = [b for b in batch if b[0] is not None]
    if not good:
        return None, None, bad
    blank = (torch.zeros_like(good[0][0]), -1)
    return (*default_collate([blank if b[0] is None else b for b in batch]), bad)

def image_stream(
        dataset, batch_size, *, seed, workers, limit=None, pin_memory=False, order="random"):
    """A seeded shuffle's first `limit` images; order: random, class or dirichlet:ALPHA."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(dataset), generator=gen)[:limit]
    labels = np.asarray(dataset.targets)[perm.numpy()]
    if order == "class":
        perm = perm[np.argsort(labels, kind="stable")]
    elif order.startswith("dirichlet:"):
        rng, classes = np.random.default_rng(seed), np.unique(labels)
        slots = [[] for _ in classes]
        for c in classes:  # c's images cut into slots by Dir(α) shares
            mine = perm.numpy()[labels == c]
            share = rng.dirichlet([float(order[10:])] * len(classes))
            cuts = (np.cumsum(share) * len(mine)).astype(int)[:-1]
            for slot, part in zip(slots, np.split(mine, cuts)):
                slot.extend(part)
        perm = torch.as_tensor([i for s in slots for i in rng.permutation(s)], dtype=int)
    return DataLoader(Subset(dataset, perm.tolist()), batch_size, num_workers=workers,
                      collate_fn=collate_skipping, pin_memory=pin_memory)

class Mixed(torch.utils.data.ConcatDataset):
    """--setting mixed (SAR's): all corruptions c in one stream, y + TAG·c."""
    TAG = 1000

    def __init__(self, streams):
        super().__init__(list(streams.values()))
        # one stream: no file in two corruptions' folders
        seen = {}
        for node, path in (n for ds in self.datasets for n in ds.nodes.items()):
            reached_once(seen, path, node)
        self.targets = [ds.imagenet_index[t] for ds in self.datasets for t in ds.targets]

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        c = int(np.searchsorted(self.cumulative_sizes, i, "right"))
        return (x, y + self.TAG * c) if x is not None else (x, y)

def make_synthetic_tree(root, corruptions, severity, n, size=64, seed=0):
    """An ImageNet-C-shaped tree of random JPEGs, n per corruption, 10 wnids."""
    wnids = timm.data.ImageNetInfo().label_names()[:10]
    rng = np.random.default_rng(seed)
    for c in corruptions:
        for i in range(n):
            folder = os.path.join(root, c, str(severity), wnids[i % len(wnids)])
            os.makedirs(folder, exist_ok=True)
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.JPEG"), quality=90)
    return root

def fisher_information(model, params, images, n=2000):
    """EATA's F on n clean images: batches' mean of (∇θ CE(f, argmax f))²."""
    p = {k: t.detach().requires_grad_() for k, t in params.items()}
    fisher, batches, seen = {k: torch.zeros_like(t) for k, t in p.items()}, 0, 0
    device = next(iter(p.values())).device
    for x in images:
        x = x[:n - seen].to(device)
        logits = functional_call(model, p, (x,))
        loss = F.cross_entropy(logits, logits.argmax(1))
        g = torch.autograd.grad(loss, list(p.values()))
        for k, t in zip(p, g):
            fisher[k] += t ** 2
        batches, seen = batches + 1, seen + len(x)
        if seen >= n:
            break
    return {k: f / max(batches, 1) for k, f in fisher.items()}

# -- The paper's hyperparameters --------------------------------------------
# ViT-B/16, batch 64, δ = 1e-6, tuned on the test stream.
# PAPER_DP: setting -> method -> dp_<method>'s (C, lr) at each of TUNED_EPS
TUNED_EPS = (20, 15, 10, 5, 1)
PAPER_DP = dict(
    continual=dict(
        tent=[(0.1, 0.1), (0.1, 0.05), (0.1, 0.05), (1, 1e-3), (0.1, 5e-3)],
        eata=[(1, 0.01), (1, 5e-3), (1, 5e-3), (10, 1e-4), (0.1, 5e-3)],
        sar=[(10, 5e-4), (10, 5e-4), (15, 1e-4), (15, 1e-4), (5, 1e-4)],
        deyo=[(10, 5e-5), (10, 5e-5), (1, 5e-4), (0.1, 5e-3), (0.1, 5e-3)],
        deyo_come=[(10, 1e-3), (5, 1e-3), (1, 5e-3), (5, 1e-3), (0.1, 5e-3)]),
    episodic=dict(
        tent=[(1, 0.05), (0.1, 0.5), (0.1, 0.1), (0.1, 0.1), (1, 1e-3)],
        eata=[(10, 5e-3), (0.1, 0.5), (0.1, 0.5), (0.1, 0.1), (0.1, 0.01)],
        sar=[(1, 0.05), (10, 1e-3), (1, 0.01), (0.1, 0.1), (0.1, 0.01)],
        deyo=[(1, 0.01), (1, 0.01), (10, 1e-3), (0.1, 0.1), (0.1, 1e-3)],
        deyo_come=[(10, 5e-3), (1, 0.05), (0.1, 0.1), (0.1, 0.1), (0.1, 0.01)]))
# clip-only: the originals, filters kept, per-sample clip, no noise: (C, lr)
PAPER_CLIP_ONLY = dict(
    continual=dict(tent=(0.1, 0.5), eata=(0.1, 0.5), sar=(1, 0.1), deyo=(10, 0.01),
                   deyo_come=(20, 0.01)),
    episodic=dict(tent=(1, 0.1), eata=(30, 5e-3), sar=(5, 0.05), deyo=(35, 5e-3),
                  deyo_come=(20, 0.01)))
PAPER_LR = dict(  # non-private originals
    continual=dict(tent=1e-4, eata=5e-4, sar=5e-3, deyo=5e-4, deyo_come=5e-4),
    episodic=dict(tent=1e-3, eata=1e-3, sar=5e-3, deyo=1e-3, deyo_come=1e-3))
# Constants the paper's scripts ran that differ from the originals' (filters only, so they
# matter for the originals and clip-only runs): SAR's E0 = 0.5·ln K, DeYO's τ_PLPD = 0.3.
PAPER_CONSTANTS = dict(
    sar={"e_margin": 0.5}, deyo={"plpd_threshold": 0.3}, deyo_come={"plpd_threshold": 0.3})
# Method constants settable with --hp NAME=VALUE (DPTTA's keywords, and EATA's Fisher size):
# name -> (type, low, high), the open interval each must lie in
inf = math.inf
HP_TYPES = dict(
    e_margin=(float, 0, inf), d_margin=(float, 0, inf), rho=(float, 0, inf),
    reset_ema=(float, -inf, inf), deyo_margin=(float, 0, inf), plpd_threshold=(float, -1, 1),
    patch_grid=(int, 1, inf), fisher_lambda=(float, 0, inf), fisher_size=(int, 0, inf),
    num_classes=(int, 1, inf), bn_scale=(float, 0, inf), bn_floor=(float, -inf, inf),
    bn_momentum=(float, 0, math.nextafter(1, 2)), bn_layers=(int, 0, inf))

def constants_used(method, fisher=False):
    """The --hp names that change a run of `method` (filters' where they run)."""
    base, deyo = method.removeprefix("dp_"), "deyo_margin plpd_threshold"
    filters = dict(
        eata="e_margin d_margin", sar="e_margin reset_ema", deyo=deyo, deyo_come=deyo)
    uses = [(base == "sar", "rho"), (base in SHUFFLED, "patch_grid"),
            (method == "dp_norm", "bn_scale bn_momentum bn_floor bn_layers"),
            (base in WEIGHTED, "e_margin num_classes"),  # E0 = e_margin·ln K
            (base in COME_LOSS, "num_classes"),  # COME's u = K/S
            (fisher and base == "eata", "fisher_lambda fisher_size"),
            (method in filters, f"{filters.get(method)} num_classes")]
    return {name for on, names in uses if on for name in names.split()}

def paper_hparams(method, eps=math.inf, setting="continual", clip=None):
    """(C, lr, source) from the paper's tables (an original + clip: clip-only)."""
    private, base = method.startswith("dp_"), method.removeprefix("dp_")
    if base in ("source", "norm"):
        return None, None, "no gradient step"
    table, note = base, ""
    # COME was tuned only inside DeYO; Tent shares its all-norms setup
    if base == "come":
        table, note = "tent", "; no entry for COME alone, Tent's used"
    if not private and clip is None:
        return None, PAPER_LR[setting][table], f"paper, non-private {table}, {setting}{note}"
    if not private or math.isinf(eps):
        C, lr = PAPER_CLIP_ONLY[setting][table]
        return C, lr, f"paper, clip-only {table}, {setting}{note}"
    near = min(TUNED_EPS, key=lambda e: abs(math.log(e / eps)))  # nearest, log scale
    if near != eps:
        note += f"; ε={eps:g} not tuned, nearest tuned ε={near} (log scale) used"
    C, lr = PAPER_DP[setting][table][TUNED_EPS.index(near)]
    return C, lr, f"paper, dp_{table} ε={near}, {setting}{note}"

# -- The command line --------------------------------------------------------
DEFAULT_MODEL = "vit_base_patch16_224.augreg2_in21k_ft_in1k"
# signals received, checked by the stream loop
STOP = []
PROGRESS_SECONDS = 60  # a progress line at least this often on long work

def fail(msg, code=2):  # one line on stderr; exit 2 (bad input) or code
    print(f"dptta: error: {msg}", file=sys.stderr)
    sys.exit(code)

def warn(msg):  # one line on stderr; the run goes on
    print(f"dptta: warning: {msg}", file=sys.stderr)

def require(ok, msg):
    if not ok:
        fail(msg)

def one_line(e):  # an exception's message on one line
    return " ".join(str(e).split()) or type(e).__name__

def or_fail(make, *args, **kwargs):  # make(...); a ValueError: exit 2
    try:
        return make(*args, **kwargs)
    except ValueError as e:
        fail(str(e))

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.partition(".")[0])
    ap.error = fail  # a bad flag: one line, exit 2 too
    g = ap.add_argument_group("method and privacy").add_argument
    g("--method", default="dp_tent", choices=METHODS, help="default dp_tent")
    g("--eps", type=eps_value, help="ε of a dp_ method; inf: clip only (default 5)")
    g("--delta", type=float, help="δ of a dp_ method (default 1e-6)")
    g("--privacy-unit", default="image", choices=("image", "photo"), help="photo: σ·√streams")
    g("--clip", type=float, help="per-sample clip C (default: paper's); originals: clip-only")
    g("--lr", type=float, help="SGD learning rate (default: paper's)")
    g("--hp", action="append", default=[], metavar="NAME=VALUE",
      help=f"a method constant: {', '.join(HP_TYPES)}")
    g = ap.add_argument_group("data").add_argument
    g("--data", default=os.environ.get("IMAGENET_C"), help="root (default $IMAGENET_C)")
    g("--dataset", default="imagenet_c", choices=("imagenet_c", "imagenet_r"))
    g("--severity", type=int, help="ImageNet-C's, 1-5 (default 5)")
    g("--corruptions", default=",".join(CORRUPTIONS), help="comma-separated, in order")
    g("--fisher-data", help="EATA's clean images (<wnid>/ folders)")
    g("--limit", type=int, help="images per corruption")
    g("--workers", type=int, default=min(8, os.cpu_count() or 1))
    g("--synthetic", type=int, metavar="N", help="smoke run: N random images each")
    g = ap.add_argument_group("model").add_argument
    g("--model", help=f"timm name (default {DEFAULT_MODEL})")
    g("--checkpoint", help="local weights for --model")
    g("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda if any")
    g("--amp", default="bf16", choices=("bf16", "off"), help="bf16 autocast on CUDA")
    g("--bn", choices=("train", "source"), help="BatchNorm: test batch or source stats")
    g = ap.add_argument_group("run").add_argument
    g("--setting", default="continual", choices=("continual", "episodic", "mixed"),
      help="episodic: reset before each corruption; mixed: all in one stream")
    g("--order", default="random", help="random, class or dirichlet:ALPHA")
    g("--repeat", type=int, default=1, help="stream the corruptions N times")
    g("--accumulate", type=int, default=1, help="a step per K batches")
    g("--batch-size", type=int, help="default 64 (--benchmark on CPU: 32)")
    g("--seed", type=int, default=0, help="data order, patch shuffles (never the noise)")
    g("--noise-seed", type=int, help="replay the noise: NOT private against its holder")
    g("--out", help="JSON lines, appended (default results*.jsonl)")
    g("--resume", action="store_true", help="skip a run --out holds; finish a killed one")
    g("--log-every", type=int, default=100, help="a progress line per N batches")
    g = ap.add_argument_group("tools").add_argument
    g("--summarize", metavar="JSONL", help="the paper-style tables of a file")
    g("--per-corruption", action="store_true", help="--summarize: per corruption too")
    g("--error", action="store_true", help="--summarize: error %%, not top-1")
    g("--benchmark", action="store_true", help="time a step of every method")
    g("--rounds", type=int, help="--benchmark: timed rounds (default 5)")
    g("--audit", action="store_true", help="an empirical ε lower bound")
    g("--trials", type=int, help="--audit: white-box trials (default 20000)")
    g("--e2e-trials", type=int, help="--audit: end-to-end trials (default 5000)")
    return ap.parse_args(argv)

def eps_value(text):
    """A float; a finite number too large for one (1e400) is refused, not read as inf."""
    value = float(text)
    if math.isinf(value) and text.strip().lower().lstrip("+") not in ("inf", "infinity"):
        raise argparse.ArgumentTypeError(f"{text} overflows a float: give a finite ε or inf")
    return value

def parse_hp(items):
    """["e_margin=0.5", ...] -> {"e_margin": 0.5}: known names, finite."""
    hp = {}
    for item in items:
        name, _, value = item.partition("=")
        require(name in HP_TYPES, f"--hp {item}: unknown constant; {', '.join(HP_TYPES)}")
        kind, low, high = HP_TYPES[name]
        try:
            hp[name] = kind(value)
        except ValueError:
            fail(f"--hp {item}: {value!r} is not a {kind.__name__}")
        require(math.isfinite(hp[name]), f"--hp {item}: must be finite")
        require(low < hp[name] < high, f"--hp {item}: must be in ({low:g}, {high:g})")
    return hp

def check_common(args, mode=None):
    """The flags every mode reads, none of another mode's: one line, exit 2."""
    tools = dict(rounds=("benchmark", 5), trials=("audit", 20000), e2e_trials=("audit", 5000),
                 per_corruption=("summarize", 0), error=("summarize", 0))
    for flag, (tool, default) in tools.items():
        value = getattr(args, flag)
        require(value in (None, False) or mode == tool,
                f"--{flag.replace('_', '-')} is for --{tool} only")
        if value is None:
            setattr(args, flag, default)
    require(args.eps is None or args.eps > 0, f"--eps must be > 0, got {args.eps}")
    require(args.eps is None or args.eps <= EPS_MAX or math.isinf(args.eps),
            f"--eps must be <= {EPS_MAX:g} or inf (no noise), got {args.eps}")
    require(args.delta is None or 0 < args.delta < 1,
            f"--delta must be in (0, 1), got {args.delta}")
    for flag in ("clip", "lr"):
        v = getattr(args, flag)
        require(v is None or 0 < v < math.inf, f"--{flag} must be finite and > 0, got {v}")
    lows = dict(batch_size=1, rounds=1, trials=100, e2e_trials=100, workers=0, limit=1,
                log_every=1, synthetic=1, repeat=1, accumulate=1)
    for flag, low in lows.items():
        v = getattr(args, flag)
        require(v is None or v >= low, f"--{flag.replace('_', '-')} must be >= {low}, got {v}")
    if args.model is not None:
        check_model(args.model)
    for flag in ("seed", "noise_seed"):
        v = getattr(args, flag)
        require(v is None or 0 <= v < 2 ** 63,
                f"--{flag.replace('_', '-')} must be in 0 .. 2**63 - 1, got {v}")
    require(args.device != "cuda" or torch.cuda.is_available(),
            "--device cuda: no CUDA device is visible")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = "bf16" if args.amp == "bf16" and args.device == "cuda" else "fp32"

def check_args(args):
    """Every flag checked, defaults filled in; wrong: one line, exit 2."""
    check_common(args)
    private, base = args.method.startswith("dp_"), args.method.removeprefix("dp_")
    hint = f" (try dp_{args.method})" if args.method != "source" else ""
    require(args.eps is None or private,
            f"--eps applies to dp_ methods only; {args.method} is not private{hint}")
    if private and args.eps is None:
        args.eps = 5.0
    noisy = private and math.isfinite(args.eps)  # a flag changing nothing: refused
    require(args.delta is None or noisy, "--delta applies to a dp_ method with a finite --eps")
    if noisy and args.delta is None:
        args.delta = 1e-6
    require(args.privacy_unit == "image" or noisy,
            "--privacy-unit photo applies to a dp_ method with a finite --eps")
    require(args.noise_seed is None or noisy, "--noise-seed applies to a dp_ method with a "
            "finite --eps (the others draw no noise)")
    stateless = base in ("source", "norm")
    require(not stateless or (args.clip, args.lr, args.bn) == (None, None, None),
            f"{args.method} takes no gradient step: --clip, --lr and --bn do not apply")
    # EXTRA of a grid passes --fisher-data to every cell
    if args.fisher_data and base != "eata":
        print(f"note: --fisher-data is for eata and dp_eata; {args.method} ignores it")
        args.fisher_data = None
    kind, _, alpha = args.order.partition(":")
    require(args.order in ("random", "class") or kind == "dirichlet" and _positive(alpha),
            f"--order is random, class or dirichlet:ALPHA (ALPHA > 0), got {args.order!r}")
    for flag in ("repeat", "accumulate"):  # (dp_norm keeps its average: both apply)
        require(getattr(args, flag) == 1 or args.method not in ("source", "norm"),
                f"--{flag}: {args.method} keeps no state, so it changes nothing")
    require(args.repeat == 1 or args.setting != "episodic",
            "--repeat is for continual or mixed streams (episodic resets)")
    require(args.severity is None or args.dataset == "imagenet_c",
            "--severity: ImageNet-C only")
    if args.severity is None:
        args.severity = 5
    require(1 <= args.severity <= 5, f"--severity must be in 1..5, got {args.severity}")
    args.hp = parse_hp(args.hp)
    for name in sorted(set(args.hp) - constants_used(args.method, bool(args.fisher_data))):
        fail(f"--hp {name} does not change a {args.method} run (see constants_used)")
    args.batch_size, args.model = args.batch_size or 64, args.model or DEFAULT_MODEL
    args.corruptions = [c for c in args.corruptions.split(",") if c]
    require(args.corruptions, "--corruptions is empty")
    known = CORRUPTIONS + HELD_OUT
    for c in args.corruptions:
        require(c in known, f"unknown corruption {c!r}; one of {', '.join(known)}")
    require(len(set(args.corruptions)) == len(args.corruptions),
            "--corruptions repeats one")
    if args.dataset == "imagenet_r":
        require(not args.synthetic, "--synthetic makes ImageNet-C trees, not ImageNet-R")
        args.corruptions = ["imagenet_r"]
    if args.synthetic and args.corruptions == list(CORRUPTIONS):  # a short smoke run
        args.corruptions = args.corruptions[:3]
    require(args.synthetic or args.data,
            f"no data root: pass --data or set $IMAGENET_C; {LAYOUT}")
    require(args.synthetic or os.path.isdir(args.data),
            f"--data {args.data} is not a folder; {LAYOUT}")
    for flag, fits, kind in (("checkpoint", os.path.isfile, "a file"),
                             ("fisher_data", os.path.isdir, "a folder of <wnid>/ folders")):
        path, name = getattr(args, flag), "--" + flag.replace("_", "-")
        require(path is None or os.path.exists(path), f"{name} {path} does not exist")
        require(path is None or fits(path), f"{name} {path} is not {kind}")
    check_out(args, "results-smoke.jsonl" if args.synthetic else "results.jsonl")
    return args

def _positive(text):
    try:
        return 0 < float(text) < math.inf
    except ValueError:
        return False

def check_out(args, default):
    """--out (or default): a regular file, writable, or a new one its folder can hold;
    /dev/null discards the records (said so)."""
    args.out = args.out or default
    if args.out == os.devnull:
        require(not getattr(args, "resume", False),
                f"--resume: --out {os.devnull} keeps nothing to resume")
        print(f"note: --out {os.devnull}: the records are discarded")
        return
    folder = os.path.dirname(os.path.abspath(args.out))
    require(not os.path.isdir(args.out), f"--out {args.out} is a folder")
    require(not os.path.exists(args.out) or os.path.isfile(args.out),
            f"--out {args.out} is not a regular file (a FIFO, a device?)")
    require(os.path.isdir(folder), f"--out {args.out}: its folder does not exist")
    require(os.access(args.out if os.path.exists(args.out) else folder, os.W_OK),
            f"--out {args.out} is not writable")

def check_model(name):
    """A timm name, with a pretrained tag that timm knows if it has one."""
    require(timm.is_model(name), f"unknown timm model {name!r}")
    try:
        timm.models.get_pretrained_cfg(name)
    except RuntimeError as e:
        fail(f"{e}; tags: {', '.join(timm.list_pretrained(name.split('.')[0] + '.*'))}")

def open_folder(folder):
    """A WnidFolder, or one line and exit 2 (missing, empty, not wnids)."""
    require(os.path.isdir(folder), f"missing {folder}; {LAYOUT}")
    try:
        return WnidFolder(folder)
    except (OSError, ValueError) as e:
        fail(f"{folder}: {one_line(e)}; {LAYOUT}")  # the error names the file, not the layout

def open_streams(corruptions, root, severity):
    """{corruption: WnidFolder}, all scanned before the first image."""
    return {c: open_folder(os.path.join(root, c, str(severity)) if c != "imagenet_r" else root)
            for c in corruptions}

def check_batchnorm(model, name, method, bn):
    """Per-sample gradients (dp_, --clip) need BatchNorm frozen: in the CLI's words."""
    has_bn = any(isinstance(m, BATCH_NORM) for m in model.modules())
    require(not has_bn or bn == "source",
            f"{name} has BatchNorm, which normalizes with the test batch and so mixes its "
            f"samples: {method} needs per-sample gradients; --bn source freezes it at its "
            "source statistics (a per-sample map)")

def build_model(name, checkpoint=None, random_weights=False, seed=0):
    """A timm model: pretrained, from a local checkpoint, or random (seeded: a smoke run's
    rerun or resume sees the same weights)."""
    torch.manual_seed(seed)
    try:
        model = timm.create_model(name, pretrained=not (random_weights or checkpoint))
    except Exception as e:  # no network, no cache, ...
        cfg = timm.models.get_pretrained_cfg(name)
        where = getattr(cfg, "hf_hub_id", None) or getattr(cfg, "url", None) or name
        fail(f"cannot load {name}'s weights ({where}): {one_line(e)}; offline: pass "
             "--checkpoint PATH, or HF_HUB_OFFLINE=1 for a local cache")
    if checkpoint:
        try:
            timm.models.load_checkpoint(model, checkpoint)
        except Exception as e:
            fail(f"--checkpoint {checkpoint} does not fit {name}: {one_line(e)}")
    return model

def run_key(args):
    """All that changes a result (the seed too; --summarize drops it)."""
    names = ("method eps delta privacy_unit clip lr hp batch_size setting order repeat "
             "accumulate dataset severity corruptions model bn seed noise_seed limit")
    key = {k: getattr(args, k) for k in names.split()}
    if args.synthetic:
        key.update(weights="random", data=f"synthetic:{args.synthetic}")
    else:
        key.update(weights="pretrained", data=os.path.abspath(args.data))
    if args.checkpoint:
        st = os.stat(args.checkpoint)
        key["weights"] = dict(checkpoint=os.path.abspath(args.checkpoint), bytes=st.st_size,
                              mtime=int(st.st_mtime))
    key.update(fisher_data=args.fisher_data and os.path.abspath(args.fisher_data),
               dtype=args.dtype)
    return json.loads(json.dumps(jsonable(key)))  # as read back: lists, not tuples

def jsonable(x):
    """x with non-finite floats as "inf", "-inf", "nan" (JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x

def read_jsonl(path, flag):
    """[(line number, record)] of a JSONL file. A damaged line (a record cut by a crash or a
    full disk, NUL bytes) is skipped and named; a file with no record is refused as not a
    JSONL file unless every line of it starts like one ({, UTF-8)."""
    require(os.path.isfile(path), f"{flag} {path} does not exist or is not a regular file")
    records, damaged, foreign = [], [], False
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip(b" \t\r\n\x00")
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                record = None
            if isinstance(record, dict):
                records.append((n, record))
                continue
            damaged.append(n)
            try:
                text = line.decode()
            except UnicodeDecodeError:
                text = ""
            if not text.startswith("{"):  # not a cut record: binary, or another format
                foreign = True
    require(records or not foreign, f"{path} has no JSON line: not a JSONL file?")
    if damaged:
        lines = ", ".join(map(str, damaged[:5])) + ", ..." * (len(damaged) > 5)
        warn(f"{path}: skipped {len(damaged)} damaged line(s) ({lines})")
    return records

def append_jsonl(path, record):
    """Appends one whole JSON line (ending an unended last one); failing: prints it, exit 4."""
    text = json.dumps(jsonable(record), allow_nan=False)
    line = (text + "\n").encode()
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(fd).st_size
            if end and os.pread(fd, 1, end - 1) != b"\n":
                line = b"\n" + line
            # O_APPEND: lines never interleave; a short write goes on
            while line:
                line = line[os.write(fd, line):]
        finally:
            os.close(fd)
    except OSError as e:
        print(text, flush=True)
        fail(f"cannot write {path} ({e.strerror}); the record is above", 4)

def privacy_ledger(a, streams, rounds=1, privacy_unit="image"):
    """What adapter a promises, to whom, in numbers. A step (its `releases` of σ_l each) is
    μ-GDP with μ = 2/σ, σ = σ_l/√releases; a test image is in `rounds` steps (--repeat), a
    photo in streams·rounds: μ√k over k steps (Dong, Roth & Su, Cor. 3.3)."""
    if not a.private:
        return dict(private=False, clip=a.clip)
    if a.sigma == 0:
        return dict(private=False, clip_only=True, note="clip only, not private",
                    eps=a.eps, clip=a.clip)
    sigma, k, d = a.sigma / math.sqrt(a.releases), streams * rounds, a.delta
    unit = f"one test image, replace-one neighbours, in {rounds} step(s)"
    if privacy_unit == "photo":
        unit = f"one photo, replace-one neighbours, in its {streams} stream(s) x {rounds} round(s)"
    ledger = dict(
        private=True, eps=a.eps, delta=d, privacy_unit=privacy_unit, unit=unit, clip=a.clip,
        sigma=sigma, releases=a.releases, sigma_per_release=a.sigma, rounds=rounds,
        streams=streams, mu_per_step=2 / sigma, mu_per_test_image=2 * math.sqrt(rounds) / sigma,
        eps_per_test_image=gdp_epsilon(sigma=sigma / math.sqrt(rounds), delta=d),
        mu_per_photo=2 * math.sqrt(k) / sigma,
        eps_per_photo=gdp_epsilon(sigma=sigma / math.sqrt(k), delta=d), noise="secret")
    if a.noise_seed is not None:
        ledger.update(noise="replayed", noise_seed=a.noise_seed,
                      note=f"not private against anyone who knows noise seed {a.noise_seed}")
    return ledger

def wild(settings):
    """Settings unlike the paper's, as " | order class | repeat 3"."""
    plain = dict(order="random", repeat=1, accumulate=1)
    return "".join(f" | {k} {settings.get(k, v)}" for k, v in plain.items()
                   if settings.get(k, v) != v)

def print_header(args, a, ledger, device, hp_note):
    where = device.type
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    print(f"dptta | {args.method} | {args.model} | {where} | {args.dtype}")
    if args.synthetic:
        print(f"SMOKE RUN: {args.synthetic} random images per corruption, "
              f"{'checkpoint' if args.checkpoint else 'random'} weights: accuracy is chance")
    print(f"data: {args.data} | {args.dataset} severity {args.severity} | "
          f"{len(args.corruptions)} stream(s) | {args.setting} | batch {args.batch_size} | "
          f"seed {args.seed}{wild(vars(args))}")
    clip = f"C = {a.clip:g} [{hp_note['clip']}]" if a.clip else ""
    released = "adapted θ and every prediction"
    if args.method == "dp_norm":  # L releases per image: σ_l = √L·σ each
        clip = (f"L = {a.releases} BN layers, each σ_l = √L·σ = {a.sigma:.4f}, "
                f"moments clipped to {a.hp['bn_scale']:g}·√(2·channels)")
        released = f"the {a.releases} layers' BatchNorm statistics and every prediction"
    if ledger["private"]:
        print("privacy: ({eps:g}, {delta:g})-DP per {privacy_unit} | σ = {sigma:.4f} per step "
              "(μ = 2/σ = {mu_per_step:.4f}-GDP), {what}".format(**ledger, what=clip))
        print("  per test image ({rounds} step(s)): μ = {mu_per_test_image:.4f}, ε = "
              "{eps_per_test_image:.3g} | per photo ({streams} stream(s) x {rounds} round(s)): "
              "μ = {mu_per_photo:.4f}, ε = {eps_per_photo:.3g}".format(**ledger))
        print(f"  unit: {ledger['unit']}; released: {released} for other images")
        if ledger["noise"] == "secret":
            print("  noise: secret, from OS entropy (the state file holds its generator: keep it "
                  "as private as the data)")
        else:
            print(f"  noise: NOT SECRET: replayed from --noise-seed {a.noise_seed}; "
                  f"{ledger['note']}")
    elif ledger.get("clip_only"):
        print(f"privacy: NONE: clip only (eps = inf), not private; {clip}")
    elif args.method != "source":
        print(f"not private; {'per-sample clip ' + clip if clip else 'no clipping'}")
    if a.params:
        n = sum(p.numel() for p in a.params.values())
        hp = "".join(f" | {k}={v:g}" for k, v in args.hp.items())
        print(f"lr {a.lr:g} [{hp_note['lr']}] | SGD momentum 0.9 | adapting "
              f"{len(a.params)} tensors, {n:,} scalars{hp}")
    if ledger.get("bn") == "private statistics":
        print(f"BatchNorm: private statistics in {a.releases} layer(s), the others frozen")
    elif "bn" in ledger:
        print(f"BatchNorm: {a.bn} (train: the test batch's statistics; source: frozen)")

def _stop(signum, frame):
    STOP.append(signum)
    raise KeyboardInterrupt

def progress(loader, what):
    """The loader's batches, with a line at least once a minute (--log-every is per stream)."""
    t0 = last = time.time()
    images = 0
    for batch in loader:
        yield batch
        images += len(batch[2]) if batch[0] is None else len(batch[0])
        if time.time() - last > PROGRESS_SECONDS:
            last = time.time()
            print(f"  {what}: {images}/{len(loader.dataset)} images, {rate(images, last - t0)}",
                  flush=True)

def rate(n, seconds):
    return f"{n / max(seconds, 1e-9):.3g} img/s"

def stop_unless_finite(a, where, *tensors):
    """Adapter a's θ and the tensors (logits) are finite (one sync), or exit 3."""
    tensors = (*a.params.values(), *tensors)
    checks = [torch.isfinite(t.detach()).all() for t in tensors]
    if checks and not torch.stack(checks).all():
        fail(f"θ or the logits are not finite after {where} (lr or clip too large?); "
             "stopped, no record of this corruption or run", 3)

def autocast(args):  # bf16 on CUDA (clip, noise and step stay fp32)
    return torch.autocast(args.device, torch.bfloat16, enabled=args.dtype == "bf16")

def stream_through(a, loader, c, *, args, lookup, groups=1):
    """Adapter a on loader: (correct, scored) per group (mixed: by label), unreadable."""
    device = args.device
    correct, scored = torch.zeros(2, groups, dtype=torch.long, device=device)
    unreadable, t0 = [], time.time()
    last = t0
    for i, (x, y, bad) in enumerate(loader):
        # a signal that a DataLoader worker swallowed: stop all the same
        if STOP:
            raise KeyboardInterrupt
        for path in bad:
            print(f"  unreadable, skipped: {path}", flush=True)
        unreadable += bad
        if x is None:
            continue
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # ImageNet-1k index -> index among those scored
        if lookup is not None:
            y = torch.where(y >= 0, lookup[y.clamp(min=0)], y)
        group = torch.where(y >= 0, y // Mixed.TAG, 0)
        y = torch.where(y >= 0, y % Mixed.TAG, y)  # placeholders (−1): never scored
        with autocast(args):
            logits = a(x)
        # NaN logits would predict class 0
        stop_unless_finite(a, f"batch {i + 1} of {c}", logits)
        correct += torch.bincount(group[logits.argmax(1) == y], minlength=groups)
        scored += torch.bincount(group[y >= 0], minlength=groups)
        # progress every --log-every batches, and at least once a minute
        if (i + 1) % args.log_every == 0 or time.time() - last > PROGRESS_SECONDS:
            last, seen, hits = time.time(), scored.sum().item(), correct.sum().item()
            top1 = 100 * hits / max(seen, 1)
            print(f"  {c} {seen}/{len(loader.dataset)} top-1 {top1:.1f}% "
                  f"{rate(seen, time.time() - t0)}", flush=True)
    with autocast(args):
        # the last, partial accumulate window steps too
        a.flush()
    stop_unless_finite(a, f"the last step of {c}")
    return correct.tolist(), scored.tolist(), unreadable

def main(argv=None):
    args = parse_args(argv)
    if args.summarize is not None:
        check_common(args, "summarize")
        return summarize(args.summarize, args.per_corruption, args.error)
    if args.benchmark:
        return benchmark(args)
    if args.audit:
        return audit_cli(args)
    check_args(args)
    device = torch.device(args.device)
    tuned_on = {"mixed": "continual"}.get(args.setting, args.setting)
    C, lr, source = paper_hparams(args.method, args.eps, tuned_on, args.clip)
    hp_note = {k: "given" if getattr(args, k) else source for k in ("clip", "lr")}
    args.clip, args.lr = args.clip or C, args.lr or lr
    key = run_key(args)
    run_hash = uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(key, sort_keys=True))
    # the run's state after each corruption (its noise generator too: as secret as the data);
    # /dev/null keeps nothing
    state = None if args.out == os.devnull else f"{args.out}.{run_hash}.pt"
    mine = []  # this run's records already in --out
    if args.resume and os.path.exists(args.out):
        mine = [r for _, r in read_jsonl(args.out, "--out") if r.get("key") == key]
    if any(r.get("mode") == "adapt" for r in mine):
        print(f"already in {args.out}: {args.method} eps={args.eps} seed={args.seed}; skipped")
        if os.path.exists(state):  # a kill between the run's record and the state's removal
            os.remove(state)
        return 0
    resume = None
    if state and os.path.exists(state) and args.resume:
        try:  # a killed run's state
            resume = torch.load(state, map_location=device, weights_only=False)
        except Exception as e:
            fail(f"{state} is damaged ({one_line(e)}): its run cannot go on, and starting it "
                 "afresh would release its images again; remove the file and rerun without "
                 "--resume for a new run (both runs' releases count)")
    elif any(r.get("mode") == "corruption" for r in mine):
        fail(f"--resume: {args.out} holds corruption records of this run but not its state "
             f"({state}): it cannot go on without releasing their images again; rerun without "
             "--resume for a new run (both runs' releases count)")
    handlers = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    STOP.clear()
    try:
        # the temporary tree goes on every exit path
        with contextlib.ExitStack() as cleanup:
            if args.synthetic:
                tree = tempfile.TemporaryDirectory(prefix="dptta-synthetic-")
                args.data = cleanup.enter_context(tree)
                make_synthetic_tree(args.data, args.corruptions, args.severity, args.synthetic)
            return adapt_and_record(args, key, device, hp_note, state, resume, mine)
    except SystemExit as e:
        if e.code == 3 and state and os.path.exists(state):  # diverged: nothing to resume
            os.remove(state)
        raise
    except KeyboardInterrupt:
        signum = (STOP or [signal.SIGINT])[0]
        print(f"dptta: stopped by {signal.Signals(signum).name}; finished corruptions are "
              f"in {args.out}, no final record (--resume goes on)", file=sys.stderr)
        return 128 + signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)

def adapt_and_record(args, key, device, hp_note, state, resume=None, mine=()):
    """Opens every input, then adapts; records and saves after each stream."""
    streams = open_streams(args.corruptions, args.data, args.severity)
    fisher_set = args.fisher_data and open_folder(args.fisher_data)
    fisher_size, fisher_loader = args.hp.get("fisher_size", 2000), None
    if fisher_set:  # the images the Fisher pass reads, checked before the first image
        fisher_loader = image_stream(fisher_set, args.batch_size, seed=args.seed,
                                     workers=args.workers, limit=fisher_size)
        check_public(fisher_set, streams, fisher_loader.dataset.indices)
        if args.privacy_unit == "photo":
            warn("--fisher-data under --privacy-unit photo: its images must not be photos the "
                 "streams are made of (ImageNet val is where ImageNet-C's come from)")
    model = build_model(args.model, args.checkpoint, bool(args.synthetic), args.seed)
    data_config = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**data_config)
    for ds in filter(None, [*streams.values(), fisher_set]):
        ds.transform = transform
    hp, side = dict(args.hp), min(data_config["input_size"][1:])
    require(hp.get("patch_grid", 1) <= side,
            f"--hp patch_grid={hp.get('patch_grid')}: more patches than {side} pixels")
    has_bn = any(isinstance(m, BATCH_NORM) for m in model.modules())
    require(args.bn is None or has_bn, f"--bn {args.bn}: {args.model} has no BatchNorm")
    per_sample = args.clip is not None and args.method not in ("source", "norm", "dp_norm")
    if per_sample:
        check_batchnorm(model, args.model, args.method, args.bn)
    lookup, logits = None, getattr(model, "num_classes", 0)
    # ImageNet-R: the 1000-way head read at the classes present
    if args.dataset == "imagenet_r":
        classes = sorted(set(streams["imagenet_r"].imagenet_index))
        scored = torch.as_tensor(classes, device=device)
        model.register_forward_hook(lambda m, x, out: out[:, scored])
        lookup, logits = torch.full((1000,), -1, device=device), len(classes)
        lookup[classes] = torch.arange(len(classes), device=device)
    require(hp.get("num_classes", logits) >= logits,
            f"--hp num_classes={hp.get('num_classes')} is below the model's {logits} logits")
    model = model.to(device)
    # conv trunks like channels_last
    if device.type == "cuda" and not hasattr(model, "blocks"):
        model = model.to(memory_format=torch.channels_last)
    hp.pop("fisher_size", None)
    photo = len(streams) if args.privacy_unit == "photo" else 1
    adapter = or_fail(
        DPTTA, model, args.method, eps=args.eps, delta=args.delta or 1e-6, clip=args.clip,
        lr=args.lr, privacy_unit=args.privacy_unit, repeats=args.repeat * photo,
        seed=args.seed, noise_seed=args.noise_seed, bn=args.bn or "train",
        accumulate=args.accumulate, **hp)
    if adapter.bn_src:  # dp_norm: one release per layer, refused before the first image
        size = data_config["input_size"]
        or_fail(adapter.check_releases, torch.zeros(1, *size, device=device))
    if fisher_loader is not None:
        print(f"EATA's Fisher information on {len(fisher_loader.dataset)} clean images ...",
              flush=True)
        clean = (x.to(device) for x, _, _ in progress(fisher_loader, "Fisher") if x is not None)
        with autocast(args):
            adapter.fisher = fisher_information(model, adapter.params, clean, fisher_size)
    elif adapter.base == "eata":
        warn(f"{args.method} without --fisher-data: no anti-forgetting penalty")
    ledger = privacy_ledger(adapter, len(args.corruptions), args.repeat, args.privacy_unit)
    if has_bn:  # what BatchNorm normalized with
        ledger["bn"] = "private statistics" if adapter.bn_src else adapter.bn
    print_header(args, adapter, ledger, device, hp_note)
    n = min(min(len(ds) for ds in streams.values()), args.limit or math.inf)
    if ledger["private"] and args.delta >= 1 / n:
        warn(f"δ = {args.delta:g} is not below 1/n = 1/{n} (n: a stream's images), "
             "the usual rule")
    # a run's units: each corruption (mixed: all at once), each round
    sources = streams
    if args.setting == "mixed":
        sources = {"mixed": or_fail(Mixed, streams)}
    # what a killed run resumes from (with the adapter's state, saved after each corruption)
    run = dict(key=key, run_id=uuid.uuid4().hex, rounds=[{} for _ in range(args.repeat)],
               drift={}, done=[], records=[], images=0, unreadable=[], wall=0.0)
    if resume is not None:
        require(resume["key"] == key, f"{state} belongs to another run; remove it")
        adapter.set_extra_state(resume.pop("adapter"))
        run = resume
        # the state is saved before a corruption's record: a kill between the two left the
        # record unwritten, and it is written now, once
        written = [(r.get("corruption"), r.get("round")) for r in mine
                   if r.get("mode") == "corruption" and r.get("run_id") == run["run_id"]]
        saved = [(r["corruption"], r["round"]) for r in run["records"]]
        require(set(written) <= set(saved), f"{state} is older than the records of its run in "
                f"{args.out} (a state that could not be saved): it cannot go on; rerun without "
                "--resume for a new run (both runs' releases count)")
        for record in run["records"]:
            if (record["corruption"], record["round"]) not in written:
                append_jsonl(args.out, record)
        print(f"resumed run {run['run_id']} after {', '.join(run['done'])}")
    start, drift = time.time() - run["wall"], run["drift"]
    for r, name in [(r, name) for r in range(args.repeat) for name in sources]:
        label = name if args.repeat == 1 else f"{name}#{r + 1}"
        if label in run["done"]:
            continue
        if args.setting == "episodic":
            adapter.reset()
        loader = image_stream(
            sources[name], args.batch_size, seed=args.seed + r, workers=args.workers,
            limit=args.limit, order=args.order, pin_memory=device.type == "cuda")
        t0, groups = time.time(), list(streams) if name == "mixed" else [name]
        correct, scored, bad = stream_through(
            adapter, loader, label, args=args, lookup=lookup, groups=len(groups))
        run["images"] += sum(scored)
        run["unreadable"] += bad
        drift[label] = drift_of(adapter)
        note = f" | {len(bad)} unreadable image(s) skipped" if bad else ""
        records = []
        for c, hits, n in zip(groups, correct, scored):
            run["rounds"][r][c] = top1 = 100 * hits / max(n, 1)
            records.append(dict(
                mode="corruption", run_id=run["run_id"], key=key, corruption=c, round=r + 1,
                accuracy=top1, error=100 - top1, images=n, skipped=len(bad),
                drift=drift.get(label), smoke=bool(args.synthetic)))
            moved = ""
            if drift[label] is not None:
                moved = f" | {DRIFT_LABEL[bool(adapter.bn_src)]} {drift[label]:.4f}"
            print(f"{c:<18} top-1 {top1:5.1f}% | {n} images | {rate(n, time.time() - t0)}"
                  f"{moved}{note}", flush=True)
        run["done"].append(label)
        run["records"] += records
        wall = time.time() - start
        # the state first, then the records: a kill between them loses nothing (--resume
        # writes the records it finds in the state) and duplicates nothing
        save_state(state, dict(run, wall=wall, adapter=adapter.get_extra_state()))
        for record in records:
            append_jsonl(args.out, record)
    # the mean over the rounds; each round's own in the record (the forgetting curve)
    accuracy = {c: float(np.mean([acc[c] for acc in run["rounds"]])) for c in streams}
    mean = sum(accuracy.values()) / len(accuracy)
    wall, images = time.time() - start, run["images"]
    record = dict(
        mode="adapt", run_id=run["run_id"], key=key, settings=dict(vars(args)),
        method=args.method, eps=args.eps, clip=adapter.clip, lr=adapter.lr, hp=args.hp,
        setting=args.setting, seed=args.seed, hparam_source=hp_note, ledger=ledger,
        smoke=bool(args.synthetic), device=args.device, dtype=args.dtype,
        versions={"torch": torch.__version__, "timm": timm.__version__},
        accuracy=accuracy, error={c: 100 - a for c, a in accuracy.items()}, drift=drift,
        mean=mean, images=images, skipped=len(run["unreadable"]),
        unreadable=run["unreadable"], images_per_s=images / wall, wall_s=wall,
        time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if args.repeat > 1:
        record["rounds"] = [dict(accuracy=acc, mean=float(np.mean(list(acc.values()))))
                            for acc in run["rounds"]]
        print("per round: " + " | ".join(f"{x['mean']:.1f}" for x in record["rounds"]))
    print("\n" + " | ".join(f"{c[:8]:>8}" for c in accuracy) + " |     mean")
    print(" | ".join(f"{a:8.1f}" for a in accuracy.values()) + f" | {mean:8.1f}")
    if run["unreadable"]:
        print(f"{len(run['unreadable'])} unreadable image(s) skipped in all")
    append_jsonl(args.out, record)
    if state and os.path.exists(state):
        os.remove(state)
    print(f"mean top-1 {mean:.2f}% | {rate(images, wall)} | {wall:.0f} s | "
          f"appended to {args.out}")
    return 0

DRIFT_LABEL = {False: "‖θ−θ0‖", True: "stats from source (z)"}

def drift_of(adapter):
    """How far adaptation has moved, public (a function of the releases): ‖θ − θ0‖, or
    dp_norm's averaged statistics' distance from the source's in z units; None: no state."""
    if adapter.bn_src:
        return math.sqrt(sum(m.pow(2).sum().item() + (v - 1).pow(2).sum().item()
                             for m, v in adapter.bn_ema.values()))
    if not adapter.params:
        return None
    return math.sqrt(sum((p.detach() - adapter.theta0[n]).pow(2).sum().item()
                         for n, p in adapter.params.items()))

def save_state(path, state):
    """torch.save, then a rename: a kill leaves the old state or the new."""
    if path is None:  # --out /dev/null
        return
    try:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as e:  # torch.save's full disk: RuntimeError
        warn(f"cannot save {path} ({one_line(e)}): --resume will refuse to go on "
             "(the records go on)")

# ============================================================================
# Appendix: tools (--summarize, --benchmark, --audit)
from scipy import stats

# -- --summarize: the paper's tables from a results file ---------------------
KEY_FIELDS = "method eps clip seed dataset severity model setting batch_size corruptions".split()

def finite_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

def readable(record):
    """Whether --summarize can read the record: a run's or a corruption's fields, finite."""
    key = record.get("key")
    if not isinstance(key, dict) or not all(k in key for k in KEY_FIELDS):
        return False
    if not isinstance(key["corruptions"], list):
        return False
    accuracy = record.get("accuracy")
    if record.get("mode") == "corruption":
        return finite_number(accuracy) and isinstance(record.get("corruption"), str)
    return (finite_number(record.get("mean")) and isinstance(accuracy, dict)
            and all(finite_number(a) for a in accuracy.values()))

def variant_of(key):
    """A run's column: non-private, clip-only, ε=inf (no noise) or ε=<eps>."""
    if not str(key["method"]).startswith("dp_"):
        return "clip-only" if key["clip"] else "non-private"
    column = f"ε={float(key['eps']):g}"  # "inf" in the file: ε=inf
    if key.get("privacy_unit", "image") == "photo":
        column += " photo"
    if key.get("noise_seed") is not None:  # never averaged with secret noise
        column += " noise-seed (not private)"
    return column

def cell(values, error):
    v = [100 - a for a in values] if error else values
    spread = f" ± {np.std(v, ddof=1):.1f}" if len(v) > 1 else ""
    return f"{np.mean(v):.1f}{spread} (n={len(v)})"

def summarize(path, per_corruption=False, error=False):
    """Methods × variants of complete runs, mean ± std over seeds; the rest apart. One table
    per setting (what the key holds but the method, its privacy and its hyperparameters),
    one row per method: its non-private, clip-only and ε columns side by side."""
    records, unreadable = [], []
    for n, r in read_jsonl(path, "--summarize"):
        if r.get("mode") not in ("adapt", "corruption"):
            continue  # --benchmark's and --audit's records
        if readable(r):
            records.append(r)
        else:
            unreadable.append(n)
    if unreadable:
        warn(f"{path}: skipped {len(unreadable)} record(s) lacking fields or finite numbers "
             f"(line(s) {', '.join(map(str, unreadable[:5]))})")
    finals = [r for r in records if r["mode"] == "adapt"]
    done = [r["key"] for r in finals]  # a dead run rerun to the end: done
    # run_id -> the corruption records of a run with no final record
    unfinished = {}
    for r in records:
        if r["mode"] == "corruption" and r["key"] not in done:
            unfinished.setdefault(r.get("run_id"), []).append(r)
    full = [r for r in finals if not r.get("smoke") and r["key"].get("limit") is None]
    # table -> cell (the key but the seed) -> {seed: latest record}
    tables, duplicates = {}, 0
    per_variant = ("method eps delta clip lr hp privacy_unit noise_seed accumulate fisher_data "
                   "seed").split()
    for r in full:
        key, seed = r["key"], r["key"]["seed"]
        fixed = {k: v for k, v in key.items() if k not in per_variant}
        table = json.dumps(fixed, sort_keys=True)
        cell_key = json.dumps(dict(key, seed=None), sort_keys=True)
        group = tables.setdefault(table, {}).setdefault(cell_key, {})
        duplicates += seed in group
        group[seed] = r
    what = "error %" if error else "top-1 %"
    order = ["non-private", "clip-only", "ε=inf"] + [f"ε={e:g}" for e in TUNED_EPS]
    for table, cells in tables.items():
        k, entries = json.loads(table), []
        for runs in (list(group.values()) for group in cells.values()):
            key = runs[0]["key"]
            entries.append((str(key["method"]).removeprefix("dp_"), variant_of(key), runs))
        print(f"\n{k['dataset']} severity {k['severity']} | {k['model']} | {k['setting']} | "
              f"batch {k['batch_size']}{wild(k)} | {len(k['corruptions'])} corruptions | "
              f"mean {what} over seeds")
        present = {v for _, v, _ in entries}
        columns = [c for c in order if c in present] + sorted(present - set(order))
        rows = {}
        for base, variant, runs in entries:
            # two settings of a cell (tuning) are told apart
            label = base
            if sum(e[:2] == (base, variant) for e in entries) > 1:
                key = runs[0]["key"]
                label += f" C={key['clip']} lr={key.get('lr')} {key.get('hp') or ''}"
            rows.setdefault(label, {})[variant] = cell([r["mean"] for r in runs], error)
        width = max(22, *(len(v) + 2 for row in rows.values() for v in row.values()))
        print(f"{'method':<14}" + "".join(f"{c:>{width}}" for c in columns))
        for label in sorted(rows, key=method_rank):
            row = "".join(f"{rows[label].get(c, ''):>{width}}" for c in columns)
            print(f"{label:<14}{row}")
        if per_corruption:
            print(f"per corruption, {what}:")
            for base, variant, runs in entries:
                per = {c: cell([r["accuracy"][c] for r in runs if c in r["accuracy"]], error)
                       for c in runs[0]["accuracy"]}
                print(f"  {base} {variant}: " + " | ".join(f"{c} {v}" for c, v in per.items()))
    if duplicates:
        print(f"\n{duplicates} record(s) repeat the seed of an earlier one: latest used")
    others = [r for r in finals if r not in full]
    if others:
        print("\nnot in the tables (smoke or --limit runs):")
        for r in others:
            key = r["key"]
            why = "smoke" if r.get("smoke") else f"limit {key.get('limit')}"
            print(f"  {key['method']} {variant_of(key)} seed {key['seed']} ({why}): "
                  f"mean {r['mean']:.1f}")
    if unfinished:
        print("\nunfinished runs (no final record; finished corruptions only):")
        for rs in unfinished.values():
            key = rs[0]["key"]
            accs = ", ".join(f"{r['corruption']} {r['accuracy']:.1f}" for r in rs)
            print(f"  {key['method']} eps={key['eps']} seed {key['seed']}: {len(rs)}/"
                  f"{len(key['corruptions'])} corruptions: {accs}")
    if not finals and not unfinished:
        print(f"no adaptation runs in {path}")
    return 0

def method_rank(label):
    """The method table's order; a method of the user's own after the built-ins."""
    known = ("source", "norm") + BASES
    name = label.split()[0]
    return (known.index(name) if name in known else len(known), label)

# -- --benchmark: the cost of privacy, measured side by side -----------------
# Every filter open, every sample kept: H <= ln K always, so margins of 1.01·ln K keep all;
# PLPD >= −1; SAR never resets. For random weights (benchmark) and the audit's canaries.
WIDE_OPEN = dict(
    e_margin=1.01, d_margin=math.inf, deyo_margin=1.01, plpd_threshold=-2.0,
    reset_ema=-math.inf)

def benchmark(args):
    """A step of every method, non-private, clip-only, DP, side by side."""
    check_common(args, "benchmark")
    check_out(args, "results-benchmark.jsonl")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = args.model or ("vit_base_patch16_224" if cuda else "vit_small_patch16_224")
    # acc > 1: rows of batch B that step once per acc batches, beside batch B·acc
    B, acc = args.batch_size or (64 if cuda else 32), args.accumulate
    torch.manual_seed(args.seed)
    model = timm.create_model(name, pretrained=False).to(device)
    check_batchnorm(model, f"--benchmark --model {name}", "dp_ and clip", args.bn)
    data_config = timm.data.resolve_data_config({}, model=model)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(B * acc, *data_config["input_size"], generator=gen).to(device)
    # random weights: full steps
    wide_open = dict(WIDE_OPEN, lr=1e-5, bn=args.bn or "train")
    dp = dict(clip=1.0, eps=5.0)
    specs = dict(source=("source", {}))  # row -> (method, its arguments)
    for b in BASES:
        specs.update({b: (b, {}), f"{b} clip": (b, dict(clip=1.0))})
        specs[f"dp_{b}"] = (f"dp_{b}", dp)
        if acc > 1:
            specs[f"dp_{b} {B}x{acc}"] = (f"dp_{b}", dict(dp, accumulate=acc))
    if any(isinstance(m, BATCH_NORM) for m in model.modules()):
        specs.update(norm=("norm", dict(bn="train")),
                     dp_norm=("dp_norm", dict(eps=5, bn="train")))
    # each its own copy of the model: never a shared θ
    try:
        variants = {k: DPTTA(copy.deepcopy(model), method, **{**wide_open, **kwargs})
                    for k, (method, kwargs) in specs.items()}
    except ValueError as e:
        fail(f"--benchmark --model {name}: {e}")

    def step(a):  # a window: one batch, or B at a time (accumulate)
        with autocast(args):
            for xb in x.split(len(x) // a.accumulate):
                a(xb)
        if cuda:
            torch.cuda.synchronize()

    times, peak, fallbacks = {k: [] for k in variants}, {}, sum(VMAP_FALLBACKS.values())
    for k, a in variants.items():  # warm-up; on CUDA, the peak memory
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step(a)
        peak[k] = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else math.nan
    # interleaved: drift of the machine hits every variant alike
    for _ in range(args.rounds):
        for k, a in variants.items():
            t = time.perf_counter()
            step(a)
            times[k].append(time.perf_counter() - t)
    fallbacks = sum(VMAP_FALLBACKS.values()) - fallbacks
    for k, a in variants.items():  # a NaN would have timed NaN steps
        stop_unless_finite(a, f"--benchmark's {k} steps")
    n = B * acc
    print(f"benchmark | {name} | batch {n} | {device.type} | {args.dtype} | median of "
          f"{args.rounds} interleaved rounds")
    rows_acc = f"; {B}x{acc}: a step per {acc} batches of {B}" if acc > 1 else ""
    print(f"{'variant':<16}{'ms/step':>10}{'img/s':>9}{'ratio':>8}{'peak MiB':>10}"
          f"{'per-sample g MiB':>18}   (ratio: / the plain method{rows_acc}; peak: CUDA max "
          "allocated)")
    rows = []
    for k, a in variants.items():
        ms = 1000 * float(np.median(times[k]))
        ref = k.split()[0] if a.accumulate > 1 else k.split()[0].removeprefix("dp_")
        plain = 1000 * float(np.median(times[ref]))
        # the per-sample gradients themselves: B × adapted scalars, fp32
        psg = n * sum(p.numel() for p in a.params.values()) * 4 / 2 ** 20 if a.clip else 0.0
        rows.append(dict(variant=k, ms=ms, images_per_s=1000 * n / ms, ratio=ms / plain,
                         peak_mib=peak[k], per_sample_grad_mib=psg))
        print(f"{k:<16}{ms:>10.1f}{1000 * n / ms:>9.1f}{ms / plain:>8.2f}"
              f"{'-' if math.isnan(peak[k]) else f'{peak[k]:.1f}':>10}{psg:>18.2f}")
    ops = f": {', '.join(VMAP_FALLBACKS)}" if fallbacks else ""
    print(f"vmap fallbacks: {fallbacks} (passes looping over samples; must be 0){ops}")
    with tempfile.TemporaryDirectory(prefix="dptta-bench-") as tree:
        make_synthetic_tree(tree, ["gaussian_noise"], 5, 4 * B, size=375)
        ds = WnidFolder(os.path.join(tree, "gaussian_noise", "5"),
                        timm.data.create_transform(**data_config))
        loader = image_stream(ds, B, seed=args.seed, workers=args.workers, pin_memory=cuda)
        t = time.perf_counter()
        loader_rate = sum(len(xb) for xb, _, _ in loader) / (time.perf_counter() - t)
    need_rate = max(r["images_per_s"] for r in rows[1:])
    print(f"loader: {loader_rate:.0f} img/s (375x375 JPEG, timm transform, {args.workers} "
          f"workers); the fastest step above takes {need_rate:.0f} img/s")
    append_jsonl(args.out, dict(
        mode="benchmark", model=name, batch=B, device=device.type, dtype=args.dtype,
        rounds=args.rounds, rows=rows, vmap_fallbacks=fallbacks,
        loader_images_per_s=loader_rate, versions={"torch": torch.__version__}))
    print(f"appended to {args.out}")
    return 0

# -- --audit: an empirical lower bound on ε from a distinguishing game -------
def epsilon_lower_bound(s_in, s_out, delta, confidence=0.95, gaussian=True):
    """ε_lb from the scores (large: "canary in"): a threshold picked on half
    the trials, its error rates on the other half bounded by Clopper-Pearson.
    gaussian (Nasr et al. 2023): ε of μ_lb-GDP, μ_lb = Φ⁻¹(1 − FPR) − Φ⁻¹(FNR);
    else (Kairouz et al. 2015): ε_lb = log((1 − δ − FNR)/FPR), or swapped."""
    s_in, s_out = np.asarray(s_in, float), np.asarray(s_out, float)
    h, alpha = min(len(s_in), len(s_out)) // 2, (1 - confidence) / 2

    def upper(errors):
        return stats.beta.ppf(1 - alpha, errors + 1, h - errors) if errors < h else 1.0

    def bound_at(t, part):
        fpr, fnr = upper((s_out[part] > t).sum()), upper((s_in[part] <= t).sum())
        # μ_lb of the Gaussian trade-off curve through (FPR, FNR)
        if gaussian:
            return stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = ((1 - delta - fnr) / fpr, (1 - delta - fpr) / fnr)
            return max(0.0, *np.log(ratios))

    # thresholds at false positive rates from 1/2 down to ~10/h; the best *bounded* on half 1
    cuts = np.quantile(s_out[:h], 1 - np.geomspace(0.5, min(0.5, 10 / h), 80))
    best = max(cuts, key=lambda t: bound_at(t, slice(0, h)))
    lb = bound_at(best, slice(h, 2 * h))
    if gaussian:
        return gdp_epsilon(sigma=2 / lb, delta=delta) if lb > 0 else 0.0
    return lb

def flat_sample_grads(a, x):
    """What adapter a clips, a row per sample (dp_norm: 1st BN's v_i)."""
    if a.method == "dp_norm":
        name = next(iter(a.bn_src))
        bn, seen = a.model.get_submodule(name), []
        with torch.no_grad(), bn.register_forward_pre_hook(lambda m, inp: seen.append(inp[0])):
            a.model(x)
        return bn_moments(seen[0], *a.bn_src[name], bn.eps)
    g, _ = per_sample_grads(a.model, a.params, a.loss, x, a.context(x))
    return torch.cat([t.flatten(1).float() for t in g.values()], 1)

def clip_of(a, width):
    """Adapter a's clip norm (dp_norm: scale·√width; no clip: inf)."""
    if a.method == "dp_norm":
        return a.hp["bn_scale"] * math.sqrt(width)
    return a.clip or math.inf

def craft_canaries(a, shape, *, steps=100, box=3.0, seed=0):
    """Two images whose g_i point apart: Adam on the pixels (in ±box) on
    cos(g1, g2) − 0.01·log(‖g1‖‖g2‖), a double backward (norms kept up)."""
    gen = torch.Generator().manual_seed(seed)
    imgs = torch.randn(2, *shape, generator=gen).to(next(a.model.parameters()).device)
    opt = torch.optim.Adam([imgs.requires_grad_()], lr=0.05)
    theta = {n: p.detach().requires_grad_() for n, p in a.params.items()}
    with sdpa_kernel(SDPBackend.MATH):  # twice differentiable
        for _ in range(steps):
            ctx, g = a.context(imgs.detach()), []
            for i in range(2):
                z = logits_of(functional_call(a.model, theta, (imgs[i:i + 1],)))
                loss = a.loss(z, None if ctx is None else ctx[i:i + 1]).sum()
                grads = torch.autograd.grad(loss, list(theta.values()), create_graph=True)
                g.append(torch.cat([t.flatten() for t in grads]))
            log_norms = (g[0].norm() * g[1].norm()).log()
            opt.zero_grad()
            (F.cosine_similarity(g[0], g[1], 0) - 0.01 * log_norms).backward()
            opt.step()
            with torch.no_grad():
                imgs.clamp_(-box, box)
    return imgs.detach()

@contextlib.contextmanager
def replayed_per_sample_pass(a):
    """Each batch's per-sample pass (and x′) runs once; clip, noise, step every trial."""
    memo, real, context = {}, per_sample_grads, a.context

    def once(fn, x, *args, **kwargs):
        key = (fn, x.data_ptr(), tuple(x.shape))
        if key not in memo:
            memo[key] = fn(*args, **kwargs)
        return memo[key]

    globals()["per_sample_grads"] = lambda model, params, loss_fn, x, *args, **kwargs: once(
        real, x, model, params, loss_fn, x, *args, **kwargs)
    a.context = lambda x: once(context, x, x)
    try:
        yield
    finally:
        globals()["per_sample_grads"] = real
        del a.context

def audit(a, x, canary=None, replacement=None, *, trials=20000, confidence=0.95, seed=0,
          gaussian=True):
    """The change-one game on adapter a, ε_lb at `confidence`: the attacker
    knows all but the noise and scores the release along d = clip(g_in) −
    clip(g_out). White-box: x's g_i (dp_norm: v_i) and a canary gradient
    ±10·C·u, 2C apart once clipped (no clip: C = 1). End-to-end: θ after a
    step on x and one image or the other."""
    if canary is None:
        flat = flat_sample_grads(a, x)
        clip = clip_of(a, flat.shape[1])
        size = 1.0 if math.isinf(clip) else clip
        u = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(seed))
        u = 10 * size * u.to(flat.device) / u.norm()
        worlds, d = [{"θ": torch.cat([flat, s * u[None]])} for s in (1, -1)], 2 * u / u.norm()

        def release(world):
            return clip_and_noise(world, clip, a.sigma, a.noise_gen)["θ"]
    else:
        worlds = [torch.cat([x, img[None]]) for img in (canary, replacement)]
        g = [flat_sample_grads(a, img[None]) for img in (canary, replacement)]
        clipped = [clip_and_noise({"θ": t}, clip_of(a, 1), 0.0, None)["θ"] for t in g]
        d = clipped[0] - clipped[1]

        # θ1 = θ0 − lr·Δ: the first step's momentum buffer is Δ itself
        def release(world):
            a.reset()
            a(world)
            return torch.cat([((a.theta0[n] - p.detach()) / a.lr).flatten()
                              for n, p in a.params.items()])
    with replayed_per_sample_pass(a):
        scores = [[release(w) for w in worlds] for _ in range(trials)]  # [trial][world]
    a.reset()
    s_in, s_out = ((torch.stack(s).double() @ d.double()).cpu().numpy() for s in zip(*scores))
    return epsilon_lower_bound(s_in, s_out, a.delta, confidence, gaussian)

def audit_cli(args):
    """White-box and end-to-end ε_lb of --method at --eps (tiny ViT or CNN)."""
    check_common(args, "audit")
    require(args.model is None, "--audit has its own model: --model does not apply")
    check_out(args, "results-audit.jsonl")
    private, norm = args.method.startswith("dp_"), args.method in NORM_METHODS
    require(args.eps is None or private, f"--eps is for dp_ methods only, not {args.method}")
    require(args.method != "source", "--audit: source releases nothing")
    args.delta, eps, kwargs = args.delta or 1e-6, args.eps, {}
    if private:
        eps = args.eps or 5.0
        kwargs = dict(eps=eps, delta=args.delta)
    # the originals and ε = inf: no noise, no claim
    claim = private and math.isfinite(eps)
    torch.manual_seed(args.seed)
    if norm:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    else:
        model = timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
            embed_dim=32, num_heads=2, num_classes=10)
        kwargs.update(lr=args.lr or 0.1, clip=args.clip or (1.0 if private else None))
        if not private:  # filters open: the canary is kept
            kwargs.update(WIDE_OPEN)
    a = or_fail(DPTTA, model.eval(), args.method, seed=args.seed, **kwargs)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(args.seed))
    t0 = time.time()
    games = [("white-box ", audit(a, x, trials=args.trials, seed=args.seed), args.trials,
              time.time() - t0, "")]
    # end to end: a crafted image pair, C below both gradients (both clipped)
    if not norm:
        t0, pair = time.time(), craft_canaries(a, (3, 32, 32), seed=args.seed)
        if a.clip is not None and args.clip is None:
            # C well below both, whatever DeYO's shuffle: a skipped clip would show
            a.clip = 0.25 * torch.cat([flat_sample_grads(a, pair) for _ in range(8)]).norm(
                dim=1).min().item()
        g, note = flat_sample_grads(a, pair), "; no clip"
        if a.clip:  # g_i·min(1, C/‖g_i‖)
            g = g * (a.clip / g.norm(dim=1, keepdim=True)).clamp(max=1)
            note = f"; the crafted pair is {(g[0] - g[1]).norm() / (2 * a.clip):.2f}·2C apart"
            note += f", C = {a.clip:.3g}"
        lb = audit(a, x, pair[0], pair[1], trials=args.e2e_trials)
        games.append(("end-to-end", lb, args.e2e_trials, time.time() - t0, note))
    print(f"audit | {args.method} | " + (f"claimed ε = {eps:g} at δ = {args.delta:g}, σ = "
          f"{a.sigma:.4f}" if claim else "NOT PRIVATE: no noise, no claim"))
    for name, lb, n, seconds, note in games:
        top = epsilon_lower_bound(np.ones(n), np.zeros(n), args.delta)
        limited = f" (≥: limited by {n} trials, never confused)" if lb >= top - 1e-9 else ""
        ratio = f", ε_lb/ε = {lb / eps:.2f}" if claim else ""
        print(f"{name}: ε_lb = {lb:.3f} at 95% confidence{limited}{ratio}; {n} trials per "
              f"world, {seconds:.0f} s{note}")
    if not claim:
        print(f"{args.method} is not private: its releases tell the two worlds apart")
    print("ε_lb via μ-GDP (Nasr et al. 2023; a Gaussian trade-off curve): above the claim "
          "shows a bug; below it proves nothing")
    held = not claim or all(lb <= eps for _, lb, *_ in games)
    games = {name.strip(): dict(eps_lb=lb, trials=n, seconds=s) for name, lb, n, s, _ in games}
    append_jsonl(args.out, dict(
        mode="audit", method=args.method, eps=eps, delta=args.delta, sigma=a.sigma,
        private=claim, clip=a.clip, claim_held=held, games=games))
    return int(not held)  # 1: a lower bound above the claim

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # at start-up: nothing written
        sys.exit(130)
