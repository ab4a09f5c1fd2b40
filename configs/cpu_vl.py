"""The embedded vision-language default: a tiny DeepSeek-VL (SigLIP tower, MLP aligner, the
cpu_tiny decoder) trained on text, images and video on 8 simulated CPU devices, no downloads.

Run:    python launch.py --config configs/cpu_vl.py
Prints: the corpus it builds once (captioned scikit-learn digits, sample photographs,
        moving-digit H.264 clips, scikit-image's GIF; the stdlib corpus as text), a progress line
        every 100 steps, then the held-out loss per source, the grounding scores (digit accuracy,
        chance 0.1; direction accuracy, chance 0.25; caption loss with the true vs another
        image) and greedy captions of held-out digits. docs/multimodal.md has the measured run.
Sets only what differs from the defaults in dsjax/config/sections.py.
"""

from dsjax.config import defaults


def get_config(arg=None):
    del arg
    c = defaults()
    c.model.update(dict(
        num_layers=4,        # decoder blocks (scanned)
        hidden_size=256,     # model width D
        num_heads=8,         # query heads H (head_dim = 32)
        num_kv_heads=4,      # kv heads N: grouped-query attention
        mlp_dim=768,         # SwiGLU hidden width F (divisible by mesh.tensor)
        vocab_size=512,      # 257 byte ids + the image and frame ids (257, 258), padded
    ))
    c.vision.update(dict(
        tower="siglip",      # SigLIP vision tower + DeepSeek-VL's MLP aligner
        image_size=32,       # the 8x8 digits upscaled 4x; photos and clips resized to it
        patch_size=8,        # 4 x 4 = 16 patches: 16 decoder positions per image
        hidden_size=128,     # tower width
        num_layers=2,        # tower blocks
        num_heads=4,         # tower heads
        mlp_dim=256,         # tower MLP width
        max_images=4,        # image slots per row: one clip's 4 frames, or up to 4 images
    ))
    c.mesh.update(dict(
        data=4,              # data-parallel size
        tensor=2,            # tensor-parallel size (heads, MLP, vocab; the tower's heads, MLP)
    ))
    c.data.update(dict(
        # stdlib text + cpu_vl's images and clips (dsjax/data/multimodal/vl_sources.py)
        source="vl_corpus",
        mix="text:0.2,image:0.6,video:0.2",  # share of training rows per source (image-heavy:
                                             # the digits' names are the hardest to ground)
        seq_len=128,         # tokens per row
        global_batch=16,     # rows per step across all devices
        eval_batches=4,      # held-out batches per source
        video_fps=4.0,       # frames sampled per second of clip (clips last 1 s)
        max_frames=4,        # frames kept per clip
    ))
    c.train.update(dict(
        steps=800,           # optimizer steps
        log_every=100,       # steps between progress lines
        sample_tokens=0,     # no text sample: grounding and captions are printed instead
    ))
    c.optim.update(dict(
        lr=2e-3,             # peak learning rate
        warmup_steps=50,     # linear warmup steps
    ))
    c.checkpoint.update(dict(
        every=400,           # steps between checkpoints (and one at the end)
        keep=2,              # checkpoints kept
    ))
    return c
