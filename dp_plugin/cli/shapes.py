"""Gradient shape lists of well-known models, computed from their configurations.

No weights, no framework: each function returns ``[(name, shape), ...]`` in
the order the parameters are defined (forward order; backward makes the
gradients ready roughly in reverse). Layouts follow the reference
implementations (Hugging Face ``BertModel``, torchvision's ResNet, VGG and
Inception V3 without the auxiliary head), so the parameter counts match
theirs: BERT-base 109,482,240; ResNet-50 25,557,032; ResNet-101 44,549,160;
VGG-16 138,357,544; Inception V3 23,834,568.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Shape = tuple[int, ...]
Shapes = list[tuple[str, Shape]]


def _linear(name: str, n_in: int, n_out: int, bias: bool = True) -> Shapes:
    return [(f"{name}.weight", (n_out, n_in))] + ([(f"{name}.bias", (n_out,))] if bias else [])


def _norm(name: str, n: int) -> Shapes:
    return [(f"{name}.weight", (n,)), (f"{name}.bias", (n,))]


def _conv_bn(name: str, n_in: int, n_out: int, kh: int, kw: int | None = None) -> Shapes:
    """Convolution without bias followed by batch norm (weight and bias trainable)."""
    return [(f"{name}.conv.weight", (n_out, n_in, kh, kw or kh)), *_norm(f"{name}.bn", n_out)]


def bert(layers: int = 12, hidden: int = 768, ffn: int = 3072, vocab: int = 30522,
         positions: int = 512, types: int = 2) -> Shapes:
    """BERT encoder with pooler (Hugging Face ``BertModel``; base by default)."""
    s: Shapes = [("embeddings.word", (vocab, hidden)), ("embeddings.position", (positions, hidden)),
                 ("embeddings.token_type", (types, hidden)), *_norm("embeddings.norm", hidden)]
    for i in range(layers):
        p = f"layer{i}"
        for proj in ("query", "key", "value", "attn_out"):
            s += _linear(f"{p}.{proj}", hidden, hidden)
        s += _norm(f"{p}.attn_norm", hidden)
        s += _linear(f"{p}.ffn_in", hidden, ffn) + _linear(f"{p}.ffn_out", ffn, hidden)
        s += _norm(f"{p}.ffn_norm", hidden)
    return s + _linear("pooler", hidden, hidden)


def encoder_mlm(layers: int = 4, hidden: int = 256, ffn: int = 1024, vocab: int = 8192,
                positions: int = 128) -> Shapes:
    """The BERT-like encoder of ``benchmarks/torch_step_bench.py`` (7.46 M parameters)."""
    s: Shapes = [("tokens", (vocab, hidden)), ("positions", (positions, hidden)),
                 *_norm("norm", hidden)]
    for i in range(layers):
        s += _linear(f"layer{i}.in_proj", hidden, 3 * hidden)
        s += _linear(f"layer{i}.out_proj", hidden, hidden)
        s += _linear(f"layer{i}.linear1", hidden, ffn) + _linear(f"layer{i}.linear2", ffn, hidden)
        s += _norm(f"layer{i}.norm1", hidden) + _norm(f"layer{i}.norm2", hidden)
    return s + _linear("head", hidden, hidden) + _norm("head.norm", hidden) + \
        _linear("decoder", hidden, vocab)


def resnet(blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> Shapes:
    """Bottleneck ResNet (torchvision; ResNet-50 by default, (3, 4, 23, 3) is 101)."""
    s: Shapes = [("conv1.weight", (64, 3, 7, 7)), *_norm("bn1", 64)]
    n_in = 64
    for stage, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True)):
        for b in range(count):
            p = f"layer{stage + 1}.{b}"
            s += [(f"{p}.conv1.weight", (width, n_in, 1, 1)), *_norm(f"{p}.bn1", width),
                  (f"{p}.conv2.weight", (width, width, 3, 3)), *_norm(f"{p}.bn2", width),
                  (f"{p}.conv3.weight", (4 * width, width, 1, 1)), *_norm(f"{p}.bn3", 4 * width)]
            if b == 0:
                s += [(f"{p}.downsample.weight", (4 * width, n_in, 1, 1)),
                      *_norm(f"{p}.downsample.bn", 4 * width)]
            n_in = 4 * width
    return s + _linear("fc", 2048, classes)


def vgg16(classes: int = 1000) -> Shapes:
    """VGG-16 without batch norm (torchvision ``vgg16``)."""
    s: Shapes = []
    n_in = 3
    for i, n_out in enumerate((64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)):
        s += [(f"conv{i}.weight", (n_out, n_in, 3, 3)), (f"conv{i}.bias", (n_out,))]
        n_in = n_out
    return s + _linear("fc6", 512 * 7 * 7, 4096) + _linear("fc7", 4096, 4096) + \
        _linear("fc8", 4096, classes)


def _inception_a(p: str, n: int, pool: int) -> Shapes:
    return (_conv_bn(f"{p}.b1x1", n, 64, 1) + _conv_bn(f"{p}.b5x5_1", n, 48, 1)
            + _conv_bn(f"{p}.b5x5_2", 48, 64, 5) + _conv_bn(f"{p}.dbl_1", n, 64, 1)
            + _conv_bn(f"{p}.dbl_2", 64, 96, 3) + _conv_bn(f"{p}.dbl_3", 96, 96, 3)
            + _conv_bn(f"{p}.pool", n, pool, 1))


def _inception_b(p: str, n: int) -> Shapes:
    return (_conv_bn(f"{p}.b3x3", n, 384, 3) + _conv_bn(f"{p}.dbl_1", n, 64, 1)
            + _conv_bn(f"{p}.dbl_2", 64, 96, 3) + _conv_bn(f"{p}.dbl_3", 96, 96, 3))


def _inception_c(p: str, c7: int) -> Shapes:
    s = _conv_bn(f"{p}.b1x1", 768, 192, 1) + _conv_bn(f"{p}.b7_1", 768, c7, 1)
    s += _conv_bn(f"{p}.b7_2", c7, c7, 1, 7) + _conv_bn(f"{p}.b7_3", c7, 192, 7, 1)
    s += _conv_bn(f"{p}.dbl_1", 768, c7, 1)
    for j, (kh, kw) in enumerate(((7, 1), (1, 7), (7, 1))):
        s += _conv_bn(f"{p}.dbl_{j + 2}", c7, c7, kh, kw)
    return s + _conv_bn(f"{p}.dbl_5", c7, 192, 1, 7) + _conv_bn(f"{p}.pool", 768, 192, 1)


def _inception_d(p: str) -> Shapes:
    return (_conv_bn(f"{p}.b3_1", 768, 192, 1) + _conv_bn(f"{p}.b3_2", 192, 320, 3)
            + _conv_bn(f"{p}.b7_1", 768, 192, 1) + _conv_bn(f"{p}.b7_2", 192, 192, 1, 7)
            + _conv_bn(f"{p}.b7_3", 192, 192, 7, 1) + _conv_bn(f"{p}.b7_4", 192, 192, 3))


def _inception_e(p: str, n: int) -> Shapes:
    return (_conv_bn(f"{p}.b1x1", n, 320, 1) + _conv_bn(f"{p}.b3_1", n, 384, 1)
            + _conv_bn(f"{p}.b3_2a", 384, 384, 1, 3) + _conv_bn(f"{p}.b3_2b", 384, 384, 3, 1)
            + _conv_bn(f"{p}.dbl_1", n, 448, 1) + _conv_bn(f"{p}.dbl_2", 448, 384, 3)
            + _conv_bn(f"{p}.dbl_3a", 384, 384, 1, 3) + _conv_bn(f"{p}.dbl_3b", 384, 384, 3, 1)
            + _conv_bn(f"{p}.pool", n, 192, 1))


def inception_v3(classes: int = 1000) -> Shapes:
    """Inception V3 (torchvision ``inception_v3``, without the auxiliary classifier)."""
    s = _conv_bn("c1a", 3, 32, 3) + _conv_bn("c2a", 32, 32, 3) + _conv_bn("c2b", 32, 64, 3)
    s += _conv_bn("c3b", 64, 80, 1) + _conv_bn("c4a", 80, 192, 3)
    s += _inception_a("m5b", 192, 32) + _inception_a("m5c", 256, 64)
    s += _inception_a("m5d", 288, 64) + _inception_b("m6a", 288)
    for name, c7 in (("m6b", 128), ("m6c", 160), ("m6d", 160), ("m6e", 192)):
        s += _inception_c(name, c7)
    s += _inception_d("m7a") + _inception_e("m7b", 1280) + _inception_e("m7c", 2048)
    return s + _linear("fc", 2048, classes)


MODELS: dict[str, Callable[[], Shapes]] = {
    "bert-base": bert,
    "resnet50": resnet,
    "resnet101": lambda: resnet((3, 4, 23, 3)),
    "vgg16": vgg16,
    "inception-v3": inception_v3,
    "encoder-mlm": encoder_mlm,
}
"""Every model ``dp-plugin plan --model`` and ``bench --models`` know."""


def model_shapes(name: str) -> Shapes:
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def param_count(shapes: Shapes) -> int:
    return sum(math.prod(shape) for _, shape in shapes)
