// What the browser test asks JupyterLab's page, as `window.llmuProbe`.
//
// The test (test_lab.py) drives the real user interface with Playwright; these helpers read back
// what a person would see, through the application object that `--LabApp.expose_app_in_browser`
// puts on `window.jupyterapp`:
//   open(path)       opens a notebook and waits for its kernel;
//   startRunAll()    "Run > Run All Cells"; runState() tells when it finished and the kernel's status;
//   inspect()        what the kernel produced (the notebook model) against what the page rendered
//                    (the DOM): errors, widget views, plotly figures, math, sliders;
//   sliderCandidates()  how many sliders sit in a box with an output; markSlider(i) marks the i-th
//                    for the keyboard; sliderState() gives its readout, a signature of the output
//                    beside it (text + figure data) and how often the kernel went idle;
//   save()           saves the notebook (its outputs, cell timings and widget state);
//   close()          shuts the kernel down and closes the notebook without saving again.
(() => {
  const app = window.jupyterapp;
  const WIDGET_MIME = "application/vnd.jupyter.widget-view+json";
  const PLOTLY_MIME = "application/vnd.plotly.v1+json";
  // What the page shows instead of an output that failed (or has not yet managed) to render:
  // ipywidgets' two messages, and JupyterLab's when no extension renders the output's MIME type.
  const RENDER_FAILURES = ["Error displaying widget", "Loading widget...", "No renderer could be found"];
  // IPython starts every traceback with this line; warnings printed to stderr do not have it.
  const TRACEBACK = "Traceback (most recent call last)";

  let panel = null;       // the NotebookPanel under test
  let run = null;         // the state of the last run-all
  let kernelIdles = 0;    // how often its kernel went idle: +1 after each request it handled

  // Markdown math, as JupyterLab's renderer finds it: $...$ or $$...$$ outside code.
  function hasMath(markdown) {
    const prose = markdown.replace(/```[\s\S]*?```/g, "").replace(/`[^`\n]*`/g, "");
    return /\$\$[\s\S]+?\$\$/.test(prose) || /(^|[^\\$])\$[^$\n]+\$/.test(prose);
  }

  function outputNode(child) {
    return child.node.querySelector(".jp-OutputArea-output");
  }

  function widgetRendered(node) {
    if (!node || !node.querySelector(".jupyter-widgets")) return false;
    const text = node.innerText || "";
    return !RENDER_FAILURES.some((failure) => text.includes(failure));
  }

  // A plotly figure is drawn once its <svg class="main-svg"> layers exist; the rendered output
  // node is itself the plot div (.js-plotly-plot) in JupyterLab's plotly renderer.
  function plotRendered(node) {
    if (!node) return false;
    const plot = node.matches(".js-plotly-plot") ? node : node.querySelector(".js-plotly-plot");
    return !!(plot && plot.querySelector(".main-svg"));
  }

  async function open(path) {
    panel = await app.commands.execute("docmanager:open", { path, factory: "Notebook" });
    await panel.context.ready;
    await panel.sessionContext.ready;
    kernelIdles = 0;
    panel.sessionContext.statusChanged.connect((_, status) => { if (status === "idle") kernelIdles += 1; });
    app.shell.activateById(panel.id);
    return panel.content.widgets.length;
  }

  function startRunAll() {
    run = { done: false };
    const started = performance.now();
    app.commands.execute("notebook:run-all-cells").then(
      (ok) => { run = { done: true, ok, seconds: (performance.now() - started) / 1000 }; },
      (error) => { run = { done: true, ok: false, error: String(error) }; },
    );
  }

  function runState() {
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    return { ...run, kernel: kernel ? kernel.status : "none" };
  }

  function inspect() {
    const notebook = panel.content;
    const report = {
      cells: notebook.widgets.length,
      unexecuted: [],          // code cells without an execution count after run-all
      errors: [],              // error outputs in the notebook model
      tracebacks: [],          // rendered stderr with a traceback anywhere (widget outputs too)
      renderFailures: [],      // "Error displaying widget" / "Loading widget..." anywhere
      widgets: { expected: 0, rendered: 0, missing: [] },  // widget-view outputs of cells
      plots: { expected: 0, rendered: 0, missing: [] },    // plotly outputs of cells
      nestedPlots: { total: 0, rendered: 0 },              // every plotly output, widget outputs included
      math: { cells: 0, rendered: 0, missing: [] },
      sliders: notebook.node.querySelectorAll(".widget-slider").length,
    };
    notebook.widgets.forEach((cell, index) => {
      const model = cell.model;
      if (model.type === "markdown") {
        if (hasMath(model.sharedModel.getSource())) {
          report.math.cells += 1;
          if (cell.node.querySelector("mjx-container")) report.math.rendered += 1;
          else report.math.missing.push(index);
        }
        return;
      }
      if (model.type !== "code") return;
      if (model.sharedModel.getSource().trim() && model.executionCount == null) report.unexecuted.push(index);
      const children = cell.outputArea.widgets;
      for (let j = 0; j < model.outputs.length; j++) {
        const output = model.outputs.get(j).toJSON();
        if (output.output_type === "error") {
          report.errors.push({ cell: index, ename: output.ename, evalue: String(output.evalue).slice(0, 300) });
        }
        const data = output.data || {};
        const node = children[j] ? outputNode(children[j]) : null;
        if (WIDGET_MIME in data) {
          report.widgets.expected += 1;
          if (widgetRendered(node)) report.widgets.rendered += 1;
          else report.widgets.missing.push({ cell: index, shown: node ? node.innerText.slice(0, 200) : "nothing" });
        } else if (PLOTLY_MIME in data) {
          report.plots.expected += 1;
          if (plotRendered(node)) report.plots.rendered += 1;
          else report.plots.missing.push({ cell: index, shown: node ? node.innerText.slice(0, 200) : "nothing" });
        }
      }
    });
    const root = notebook.node;
    // Rendered stderr (error outputs render as stderr too), wherever it is: cell outputs and the
    // Output widgets of interactive pictures, whose tracebacks never reach the notebook model.
    root.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').forEach((node) => {
      const text = node.innerText || "";
      if (text.includes(TRACEBACK)) {
        const cell = node.closest(".jp-Cell");
        report.tracebacks.push({ cell: cell ? notebook.widgets.findIndex((w) => w.node === cell) : -1,
                                 text: text.slice(-600) });
      }
    });
    root.querySelectorAll(".jp-OutputArea-output").forEach((node) => {
      const text = node.innerText || "";
      if (RENDER_FAILURES.some((failure) => text.includes(failure)) && !node.querySelector(".jp-OutputArea-output")) {
        report.renderFailures.push(text.slice(0, 200));
      }
    });
    root.querySelectorAll(".jp-RenderedPlotly").forEach((node) => {
      report.nestedPlots.total += 1;
      if (plotRendered(node)) report.nestedPlots.rendered += 1;
    });
    return report;
  }

  // The sliders whose box (ipywidgets' VBox, as llmu.viz.interactive builds it) also holds an
  // Output: moving one must change that Output through the kernel. In notebook order.
  function sliderCandidates() {
    return [...panel.content.node.querySelectorAll(".widget-slider")].filter((slider) => {
      const box = slider.closest(".widget-vbox");
      return box && box.querySelector(".widget-output") && slider.querySelector(".noUi-handle");
    });
  }

  // Marks candidate `index` (data-llmu-probe) so that the test can press keys on its handle.
  function markSlider(index) {
    const slider = sliderCandidates()[index];
    if (!slider) return null;
    document.querySelectorAll("[data-llmu-probe]").forEach((n) => n.removeAttribute("data-llmu-probe"));
    slider.setAttribute("data-llmu-probe", "slider");
    slider.closest(".widget-vbox").setAttribute("data-llmu-probe", "box");
    const cell = slider.closest(".jp-Cell");
    const label = slider.querySelector(".widget-label");
    return { cell: panel.content.widgets.findIndex((w) => w.node === cell),
             description: label ? label.innerText : "" };
  }

  function sliderState() {
    const slider = document.querySelector('[data-llmu-probe="slider"]');
    const box = document.querySelector('[data-llmu-probe="box"]');
    const output = box.querySelector(".widget-output");
    const plots = [...output.querySelectorAll(".js-plotly-plot")].map((gd) =>
      JSON.stringify({ data: gd.data, title: gd.layout && gd.layout.title,
                       annotations: gd.layout && gd.layout.annotations, shapes: gd.layout && gd.layout.shapes }));
    const readout = slider.querySelector(".widget-readout");
    return {
      idles: kernelIdles,
      readout: readout ? (readout.innerText || readout.value || "").trim() : "",
      text: output.innerText,
      plots,
      drawn: [...output.querySelectorAll(".js-plotly-plot")].every((gd) => gd.querySelector(".main-svg")),
    };
  }

  // Height of the notebook's content and the top of its scroller, for the full-page screenshot.
  function scrollGeometry() {
    const outer = panel.content.node.querySelector(".jp-WindowedPanel-outer") || panel.content.node;
    return { top: outer.getBoundingClientRect().top, height: outer.scrollHeight };
  }

  function scrollTo(y) {
    const outer = panel.content.node.querySelector(".jp-WindowedPanel-outer") || panel.content.node;
    outer.scrollTop = y;
    return outer.scrollTop;
  }

  // Save the notebook as it is now (outputs, cell timings, widget state): its run is then judged
  // from the file, as nbgrader judges a notebook.
  async function save() {
    await panel.context.save();
    return panel.context.path;
  }

  async function close() {
    if (!panel) return;
    const closing = panel;
    panel = null;
    await closing.sessionContext.shutdown();
    closing.context.model.dirty = false;
    closing.dispose();
  }

  window.llmuProbe = { open, startRunAll, runState, inspect, sliderCandidates: () => sliderCandidates().length, markSlider, sliderState, scrollGeometry, scrollTo, save, close };
})();
