"""MkDocs hook: the configuration reference page (reference/configuration.md) is generated from the
typed config when the site builds (rft/config/reference.py), so it lists exactly the keys, defaults
and doc lines of the code being documented."""

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from rft.config.reference import reference_markdown

    files.append(File.generated(config, "reference/configuration.md", content=reference_markdown()))
    return files
