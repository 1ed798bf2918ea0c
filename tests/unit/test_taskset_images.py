"""Taskset rows with images (data.image_key, rft/data/images.py): paths beside the taskset, HF
`datasets` Image features in parquet, the Hub's chat layout with image parts and verl's `<image>`
marks; a row whose image cannot be read, or whose marks and images differ, is skipped and counted
with a message naming the key."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from rft.data.images import PLACEHOLDER, decode
from rft.data.taskset import read_taskset


def _png(colour: str, size: int = 28) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


def test_image_paths_marks_and_chat_parts_become_placeholders_and_bad_images_are_skipped(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "red.png").write_bytes(_png("red"))
    (tmp_path / "images" / "blue.png").write_bytes(_png("blue"))
    (tmp_path / "images" / "broken.png").write_bytes(_png("red")[:40])  # truncated
    rows = [
        {"question": "<image>What colour?", "answer": "red", "images": ["images/red.png"]},
        {"question": "Compare <image> and <image>.", "answer": "no", "images": ["images/red.png", "images/blue.png"]},
        {"question": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
         "answer": "blue", "images": "images/blue.png"},
        {"question": "No mark here", "answer": "red", "images": ["images/red.png"]},  # placed before the text
        {"question": "<image>broken", "answer": "red", "images": ["images/broken.png"]},
        {"question": "<image>missing", "answer": "red", "images": ["images/nowhere.png"]},
        {"question": "<image><image>two marks", "answer": "red", "images": ["images/red.png"]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks, report = read_taskset(str(path), "question", "answer", image_key="images")
    assert [t.index for t in tasks] == [0, 1, 2, 3]
    assert tasks[0].prompt == PLACEHOLDER + "What colour?"
    assert tasks[1].prompt == f"Compare {PLACEHOLDER} and {PLACEHOLDER}."
    assert tasks[2].prompt == PLACEHOLDER + "Colour?"
    assert tasks[3].prompt == PLACEHOLDER + "No mark here"
    assert decode(tasks[1].images[1]).getpixel((0, 0)) == (0, 0, 255)
    assert report.skipped == 3
    examples = "\n".join(report.skipped_examples)
    assert "line 5: image images[0] is not a readable image" in examples
    assert "line 6: image images[0]: cannot read" in examples and "nowhere.png" in examples
    assert "line 7: the prompt marks 2 image(s) with <image> but 'images' holds 1" in examples


def test_hf_image_features_in_parquet_are_read_from_their_bytes(tmp_path):
    table = pa.table({"problem": ["<image>Which colour?", "<image>And this one?"],
                      "solution": ["green", "red"],
                      "images": [[{"bytes": _png("green"), "path": "green.png"}],
                                 [{"bytes": None, "path": str(tmp_path / "red.png")}]]})
    (tmp_path / "red.png").write_bytes(_png("red"))
    pq.write_table(table, tmp_path / "train.parquet")
    tasks, report = read_taskset(str(tmp_path / "train.parquet"), "problem", "solution", image_key="images")
    assert report.skipped == 0
    assert [decode(t.images[0]).getpixel((1, 1)) for t in tasks] == [(0, 128, 0), (255, 0, 0)]
