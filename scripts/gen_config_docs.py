"""Write docs/configuration.md from the settings' declarations (composed in
weightcast.runtime.config)."""

from pathlib import Path

from weightcast.runtime.settings import reference_markdown

if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    target.write_text(reference_markdown())
    print(f"wrote {target}")
