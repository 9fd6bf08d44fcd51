"""The links at the end of a notebook open llmu's code in JupyterLab, as ``llmu lab`` starts it.

A learner runs ``llmu lab`` (or ``make lab``), opens a notebook from the file browser, reads to the
end and clicks a file under "The code behind this notebook". The file must open in a tab of the
lab, not fail with a 404: JupyterLab only opens what its root holds, and the links lead from
``course/NN_x/`` up to ``llmu/``. ``checkout_lab`` (conftest.py) starts JupyterLab with the command
line of ``llmu lab`` (:func:`llmu.cli.lab_command`) in a copy of the checkout.
"""

from __future__ import annotations

import pytest

from llmu import course

pytestmark = [pytest.mark.browser]

#: The link clicked, and a shared helper's ``__init__.py`` whose name must show as it is.
LINKED_FILE = "llmu/kvcache/kernels.py"
INIT_FILE = "llmu/viz/__init__.py"


def _open_from_file_browser(page, name: str) -> None:
    """Double-click ``name`` in the file browser's listing, as a person opens a folder or file."""
    item = page.locator(".jp-DirListing-item", has=page.locator(".jp-DirListing-itemText", has_text=name)).first
    item.wait_for()
    item.dblclick()


def test_a_code_link_opens_its_file_in_a_lab_tab(browser, checkout_lab):
    lab = checkout_lab
    (notebook,) = course.course_dir(lab.root).glob("*/*.ipynb")  # the one notebook of the checkout's copy
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors, missing = [], []
    page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text[:300]))
    page.on("response", lambda r: r.status == 404 and "/api/contents/" in r.url and missing.append(r.url))
    try:
        # What `llmu lab` opens: the server's address, which leads to the course's folder.
        page.goto(f"{lab.url}/?token={lab.token}")
        page.wait_for_function("window.jupyterapp !== undefined && window.jupyterapp.shell !== undefined",
                               timeout=120_000)
        page.evaluate("async () => { await window.jupyterapp.started; await window.jupyterapp.restored; }")
        assert "/lab/tree/course" in page.url, page.url

        _open_from_file_browser(page, notebook.parent.name)
        _open_from_file_browser(page, notebook.name)
        page.wait_for_function(
            "() => { const w = window.jupyterapp.shell.currentWidget;"
            " return !!(w && w.context && w.context.path.endsWith('.ipynb') && w.context.isReady); }")

        links = page.locator(".jp-MarkdownOutput a")
        link = links.filter(has_text=LINKED_FILE).first
        link.wait_for()
        # The link text is the path in backticks: `__init__.py` is shown as it is, not as bold "init".
        shown = page.locator(".jp-MarkdownOutput a code").all_text_contents()
        assert LINKED_FILE in shown and INIT_FILE in shown, shown
        assert links.filter(has_text="GitHub").count() == len(shown), "every file has its GitHub link"

        link.scroll_into_view_if_needed()
        link.click()
        opened = page.wait_for_function(
            "() => { const w = window.jupyterapp.shell.currentWidget;"
            " return w && w.context && !w.context.path.endsWith('.ipynb') && w.context.isReady"
            " ? { path: w.context.path, label: w.title.label, text: w.context.model.toString() } : null; }",
            timeout=30_000,
        ).json_value()
    except Exception as exc:
        raise AssertionError(f"{exc}\n404s: {missing}\npage errors: {errors[-5:]}") from exc
    finally:
        context.close()
    assert opened["path"] == LINKED_FILE and opened["label"] == "kernels.py", opened
    assert opened["text"] == (lab.root / LINKED_FILE).read_text(encoding="utf-8"), "the tab shows another text"
    assert not missing, f"JupyterLab could not find: {missing}"
