"""A tiny vision-language setup built offline: pictures of shapes drawn with PIL, questions about
them in TRL's vision format, a word-level tokenizer and a Qwen2-VL processor built from parts, and
a tiny Qwen2-VL from a config. For notebook 07 and the vision SFT tests; nothing is downloaded.

    from megatrain_nb.assets.vision import shapes_dataset, tiny_qwen2_vl, vision_processor
    processor = vision_processor()                  # Qwen2VLProcessor: word tokenizer + PIL image processor
    model = tiny_qwen2_vl(processor)                # AutoModelForImageTextToText from a config
    ds = shapes_dataset(64)                         # {"images": [PIL image], "messages": [...]} rows

The processor is Qwen2-VL's own (its image tokens, its pixel patches, its ``image_grid_thw``) with no
video processor (that needs torchvision): :class:`ImageOnlyQwen2VLProcessor`. Pillow is needed
(``pip install "megatrain-nb[vision]"``).
"""
from __future__ import annotations

import random

from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2VLProcessor

from . import build_word_tokenizer

SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "green", "blue", "yellow")
QUESTIONS = ("What is in the picture ?", "What do you see ?", "Describe the picture .")
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE_SIZE = 16   # pixels a side: 8 x 8 patches of 2, merged 2 x 2: 16 image tokens

# Each turn: <|role|> content <|end|>; an image part is <|vision_start|><|image_pad|><|vision_end|>
# (the processor repeats <|image_pad|> once per image token); the assistant's turn is inside the
# generation marks, so assistant_only_loss trains the answer and its end.
VISION_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' }}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for part in parts %}{{ part['text'] }}{% endfor %}{{ ' <|end|>' }}{% endgeneration %}{{ ' ' }}"
    "{% else %}"
    "{% for part in parts %}{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|> ' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{{ ' <|end|> ' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor (which needs torchvision): images and text."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def _words() -> list:
    words = {"a", "is", "in", "the", "picture", ".", "?"}
    for q in QUESTIONS:
        words.update(q.split())
    return sorted(words | set(SHAPES) | set(COLOURS))


def vision_processor(image_size: int = IMAGE_SIZE) -> ImageOnlyQwen2VLProcessor:
    """Qwen2-VL's processor over a word-level tokenizer of the shapes' words: 2-pixel patches merged
    2 x 2, images resized to ``image_size`` pixels a side at most."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_word_tokenizer(_words(), VISION_TEMPLATE)
    tok.add_special_tokens({"extra_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    images = Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                      max_pixels=image_size * image_size)
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tok, chat_template=VISION_TEMPLATE)


def tiny_qwen2_vl(processor, *, hidden: int = 32, layers: int = 2, vision_depth: int = 2, seed: int = 0):
    """A Qwen2-VL (``AutoModelForImageTextToText``) from a config, sized to ``processor``'s tokenizer."""
    import torch

    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    half = hidden // 4 // 2   # M-RoPE's sections (time, height, width) share half a head's dimensions
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
                                 "rope_theta": 10000.0},
                bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(depth=vision_depth, embed_dim=hidden, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=hidden,
                  intermediate_size=2 * hidden)
    cfg = AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision,
                               image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(cfg).eval()


def draw(shape: str, colour: str, size: int = IMAGE_SIZE, rng: random.Random | None = None):
    """A ``size`` x ``size`` PIL picture of one ``colour`` ``shape`` on white, placed at random by ``rng``."""
    from PIL import Image, ImageDraw

    rng = rng or random.Random(0)
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    side = rng.randint(size * 3 // 4, size - 2)   # large, near the middle: a tiny model tells them apart
    x, y = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
    box = (x, y, x + side, y + side)
    if shape == "circle":
        d.ellipse(box, fill=colour)
    elif shape == "square":
        d.rectangle(box, fill=colour)
    else:
        d.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=colour)
    return img


def shapes_dataset(n: int = 64, seed: int = 0, size: int = IMAGE_SIZE):
    """``n`` rows in TRL's vision format: one picture each (``images``), a question about it and its
    answer (``messages``, content as image/text parts): "a red circle ."."""
    import datasets

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        shape, colour = rng.choice(SHAPES), rng.choice(COLOURS)
        rows.append({"images": [draw(shape, colour, size, rng)], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS)}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"a {colour} {shape} ."}]}]})
    return datasets.Dataset.from_list(rows)


__all__ = ["ImageOnlyQwen2VLProcessor", "VISION_TEMPLATE", "draw", "shapes_dataset", "tiny_qwen2_vl",
           "vision_processor"]
