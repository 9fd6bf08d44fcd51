"""Which cells of a released notebook behave exactly as in the instructor's, so that checking the
release need not run them again, and self-grading (``llmu grade NOTEBOOK``, :mod:`llmu.selfgrade`)
need not run them to score the learner's answers.

The release check runs the student notebook on its stubs: every graded test cell must fail, and
every other cell must still run. Most of a notebook's time goes into cells that never touch an
exercise (loading the model, a benchmark of llmu's own kernels, a training demo): in the release
they are the instructor's cells, byte for byte, reading nothing the learner writes, so they do
what they did in the instructor notebook's run, which the suite makes anyway. Such a cell may be
left out of the release run if no cell that does run needs it.

Which cells must run, from the names each cell binds and reads (Python's ``ast``, no execution):

1. every answer cell (on the stubs), every graded test cell, and every code cell that is not the
   same as in the instructor notebook;
2. every cell that reads a name an answer cell binds, or a name bound by a cell that does
   (transitively): its behaviour can depend on the learner's code. Assigning to ``x.attr`` or
   ``x[i]`` counts as binding ``x``: an object that carries the learner's code taints its users.
   An import does not taint the name it binds (``import torch`` in an answer binds the library).
   A function that declares ``global x`` may bind ``x`` in every cell that reads the function's
   name (it may call it);
3. every cell that binds a name a running cell reads, from any earlier cell (transitively): the
   running cells must see the state they saw in the instructor's run;
4. any cell the analysis cannot follow: a syntax error (IPython magics), ``exec``/``eval``,
   ``globals()``/``locals()``/``vars()``, ``get_ipython``, ``import *``, ``match``.

A call made for its effect counts as binding what it may change: ``model.eval()`` or
``items.append(x)`` the object it is called on, ``shuffle(items)`` the names passed to it (not
``print`` and the other builtins, nor ``display``), and on a module only a setter of global
state (``torch.manual_seed(0)``, ``torch.set_num_threads(1)``, ``np.random.seed``), not
``viz.show(fig)``. What it still cannot see is a change made deeper: a function that changes an
object it reaches without being given it, or calls another that declares ``global`` (only direct
callers are followed). A cell left out never runs such a call. A running cell that needed it
fails loudly (the check then shows it); it cannot make a graded cell fail that would pass, since
the stubs make every graded cell fail first.
"""

from __future__ import annotations

import ast
import builtins
import re

from llmu.cell_module import python_of

__all__ = ["cells_to_run", "release_check_skips"]

_OPAQUE_CALLS = {"exec", "eval", "globals", "locals", "vars", "get_ipython", "__import__"}
_BUILTINS = set(dir(builtins))
#: What a module's function that changes global state is called (``manual_seed``, ``seed``,
#: ``set_default_dtype``, ``use_deterministic_algorithms``, ``enable_grad``).
_STATE_SETTER = re.compile(r"seed|^set|^use_|^enable|^disable|^reset|^init")
#: Functions called for their output that change none of their arguments.
_PURE_CALLS = (_BUILTINS - {"exec", "eval", "setattr", "delattr", "next", "iter", "__import__"}) | {"display"}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _free_names(node) -> set[str]:
    """Names a nested scope (function, lambda, class body, comprehension) reads from outside it:
    every name it loads minus those it binds itself (parameters, assignments, loop targets)."""
    loads, stores = set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (loads if isinstance(sub.ctx, ast.Load) else stores).add(sub.id)
        elif isinstance(sub, ast.arg):
            stores.add(sub.arg)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not node:
            stores.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            stores.update((a.asname or a.name).split(".")[0] for a in sub.names)
        elif isinstance(sub, ast.Global):
            loads.update(sub.names)
    return loads - stores


class _Cell(ast.NodeVisitor):
    """What one cell binds and reads, in the order its top-level code runs.

    ``certain``: names it surely binds (unconditional, at top level); ``maybe``: names it may bind
    or changes in place (inside ``if``/``for``/``try``/``with``, ``x.a = ...``, ``x[i] = ...``);
    ``imports``: names bound by an import; ``reads``: names it reads before binding them itself;
    ``late``: names read by the functions, lambdas and classes it defines, looked up when called.
    """

    def __init__(self):
        self.certain: set[str] = set()
        self.maybe: set[str] = set()
        self.imports: set[str] = set()
        self.reads: set[str] = set()
        self.late: set[str] = set()
        self.globals_of: dict[str, set[str]] = {}   # function name -> the globals it declares
        self.effects: set[tuple[str, str]] = set()  # (x, name) of each statement `x.name(...)`
        self.opaque = False
        self._bound: set[str] = set()
        self._conditional = 0

    def _read(self, name):
        if name not in self._bound:
            self.reads.add(name)

    def _bind(self, name):
        (self.maybe if self._conditional else self.certain).add(name)
        self._bound.add(name)   # inside a block, only until the block ends (see _conditionally)

    def _bind_target(self, node):
        if isinstance(node, ast.Name):
            self._bind(node.id)
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            self.visit(node)            # x.a = ... reads x (and x[i] reads i)
            base = node
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if isinstance(base, ast.Name):
                self.maybe.add(base.id)  # x now holds something new
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self._bind_target(elt)
        elif isinstance(node, ast.Starred):
            self._bind_target(node.value)
        else:
            self.visit(node)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self._read(node.id)
        else:
            self._bind(node.id)

    def visit_Assign(self, node):
        self.visit(node.value)
        for t in node.targets:
            self._bind_target(t)

    def visit_AugAssign(self, node):
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self._read(node.target.id)
        self._bind_target(node.target)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
            self._bind_target(node.target)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.maybe.add(node.target.id)

    def visit_Delete(self, node):
        for t in node.targets:
            if isinstance(t, ast.Name):
                self.maybe.add(t.id)
            else:
                self._bind_target(t)

    def _conditionally(self, *bodies):
        """Visit code that may not run: what it binds is bound for the reads inside it (after the
        binding), and only "may bind" for what comes after the block."""
        outside = set(self._bound)
        self._conditional += 1
        for body in bodies:
            for stmt in body:
                self.visit(stmt)
        self._conditional -= 1
        self._bound = outside

    def visit_If(self, node):
        self.visit(node.test)
        self._conditionally(node.body, node.orelse)

    def visit_While(self, node):
        self._conditional += 1
        self.visit(node.test)
        self._conditional -= 1
        self._conditionally(node.body, node.orelse)

    def visit_For(self, node):
        self.visit(node.iter)
        outside = set(self._bound)
        self._conditional += 1
        self._bind_target(node.target)
        self._conditional -= 1
        self._conditionally(node.body, node.orelse)
        self._bound = outside

    visit_AsyncFor = visit_For

    def visit_With(self, node):
        for item in node.items:
            self.visit(item.context_expr)
        outside = set(self._bound)
        self._conditional += 1
        for item in node.items:
            if item.optional_vars is not None:
                self._bind_target(item.optional_vars)
        self._conditional -= 1
        self._conditionally(node.body)
        self._bound = outside

    visit_AsyncWith = visit_With

    def visit_Try(self, node):
        handlers = []
        for h in node.handlers:
            if h.type is not None:
                self.visit(h.type)
            if h.name:
                self.maybe.add(h.name)
                self._bound.add(h.name)
            handlers.append(h.body)
        self._conditionally(node.body, *handlers, node.orelse, node.finalbody)

    visit_TryStar = visit_Try

    def visit_Import(self, node):
        for alias in node.names:
            name = (alias.asname or alias.name).split(".")[0]
            self.imports.add(name)
            self._bound.add(name)

    def visit_ImportFrom(self, node):
        for alias in node.names:
            if alias.name == "*":
                self.opaque = True
            else:
                self.imports.add(alias.asname or alias.name)
                self._bound.add(alias.asname or alias.name)

    def _scope(self, node):
        # decorators, defaults, annotations and bases run now; the body when called
        for expr in getattr(node, "decorator_list", []):
            self.visit(expr)
        if isinstance(node, ast.ClassDef):
            for expr in node.bases + [k.value for k in node.keywords]:
                self.visit(expr)
        else:
            for expr in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
                self.visit(expr)
        self.late |= _free_names(node)
        declared = {name for sub in ast.walk(node) if isinstance(sub, ast.Global) for name in sub.names}
        if not isinstance(node, ast.Lambda):
            self._bind(node.name)
            if declared:               # `global x` binds x in the cells that call it (cells_to_run)
                self.globals_of[node.name] = declared

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _scope

    def _comprehension(self, node):
        for name in _free_names(node):
            self._read(name)
        for sub in ast.walk(node):
            if isinstance(sub, ast.NamedExpr):
                self.maybe.add(sub.target.id)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in _OPAQUE_CALLS:
                self.opaque = True

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in _OPAQUE_CALLS:
            self.opaque = True
        self.generic_visit(node)

    def visit_Expr(self, node):
        """A call made for its effect (``torch.manual_seed(0)``, ``model.eval()``,
        ``shuffle(items)``) may change the object it is called on and the objects passed to it:
        each counts as "may bind" (rule 3 then keeps the call for the cells that read them)."""
        self.visit(node.value)
        if isinstance(node.value, ast.Call):
            call = node.value
            base = call.func
            while isinstance(base, (ast.Attribute, ast.Subscript, ast.Call)):
                base = base.func if isinstance(base, ast.Call) else base.value
            if isinstance(base, ast.Name) and base is not call.func:
                attr = call.func.attr if isinstance(call.func, ast.Attribute) else ""
                self.effects.add((base.id, attr))    # resolved in cells_to_run: a module or not
            if isinstance(call.func, ast.Name) and call.func.id in _PURE_CALLS:
                return                  # print(x), display(fig), len(x): they change nothing
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                if isinstance(arg, ast.Starred):
                    arg = arg.value
                if isinstance(arg, ast.Name):
                    self.maybe.add(arg.id)


def _cell(source: str) -> _Cell | None:
    """What ``source`` binds and reads; None when it cannot be followed (rule 4)."""
    try:
        tree = ast.parse(python_of(source))
    except (SyntaxError, ValueError):
        return None
    cell = _Cell()
    cell.visit(tree)
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in _OPAQUE_CALLS:
            cell.opaque = True
        if isinstance(sub, ast.Match):   # its patterns bind names this analysis does not follow
            cell.opaque = True
    if cell.opaque or "get_ipython" in cell.reads | cell.late:
        return None
    return cell


def cells_to_run(sources: list[str], seeds: set[int], raising: set[int] = frozenset(), *,
                 taint: bool = True) -> set[int]:
    """Indices of the code cells ``sources`` that must run, given the cells ``seeds`` that must
    (answer and test cells, and changed ones): rules 2 to 4 of the module docstring. A cell in
    ``raising`` (a test on the stubs) may stop anywhere: what it binds counts as "may bind".
    ``taint=False`` leaves rule 2 out: only the seeds and what they need run (grading one
    exercise needs its answers and tests, not every cell downstream of them)."""
    cells = [_cell(s) for s in sources]
    for i in raising:
        if cells[i] is not None:
            cells[i].maybe |= cells[i].certain
            cells[i].certain = set()
    # `x.f(...)` for its effect may change x; on a module only a setter of global state does
    # (torch.manual_seed, np.random.seed, torch.set_default_dtype), not viz.show(fig)
    modules = set().union(*(c.imports for c in cells if c is not None))
    for c in cells:
        for name, attr in (c.effects if c is not None else ()):
            if name not in modules or _STATE_SETTER.search(attr):
                c.maybe.add(name)
    # a cell that reads a function declaring `global x` may bind x (it may call the function)
    globals_of: dict[str, set[str]] = {}
    for c in cells:
        for name, declared in (c.globals_of.items() if c is not None else ()):
            globals_of.setdefault(name, set()).update(declared)
    for c in cells:
        if c is not None:
            for name in (c.reads | c.late) & set(globals_of):
                c.maybe |= globals_of[name]
    everywhere = set().union(*(c.certain | c.maybe | c.imports for c in cells if c is not None))
    # builtins (print, len) tie no cells together, unless some cell rebinds one
    for c in cells:
        if c is not None:
            c.reads -= _BUILTINS - everywhere
            c.late -= _BUILTINS - everywhere

    def binds(j, name):
        c = cells[j]
        return c is None or name in c.certain or name in c.maybe or name in c.imports

    def definers(i) -> set[int]:
        """The cells whose bindings cell i may see: for each name read at the top level, the
        cells back to the last one that surely binds it; for names read by its functions, any."""
        c = cells[i]
        if c is None:
            return set(range(len(cells)))
        found = set()
        for name in c.reads:
            for j in range(i - 1, -1, -1):
                if binds(j, name):
                    found.add(j)
                    if cells[j] is not None and (name in cells[j].certain or name in cells[j].imports):
                        break
        for name in c.late:
            found |= {j for j in range(len(cells)) if j != i and binds(j, name)}
        return found

    deps = [definers(i) for i in range(len(cells))]
    run = set(seeds) | {i for i, c in enumerate(cells) if c is None}
    # rule 2: a cell is tainted when a cell it may see is (imports aside, see the docstring)
    tainted = set(seeds)
    grew = taint
    while grew:
        grew = False
        for i in range(len(cells)):
            if i in tainted:
                continue
            c = cells[i]
            sources_ = {j for j in deps[i] if j in tainted}
            # a tainted cell that only imports the names this one reads gives it nothing new
            if any(cells[j] is None or (c is not None and (c.reads | c.late) & (cells[j].certain | cells[j].maybe))
                   for j in sources_):
                tainted.add(i)
                grew = True
    run |= tainted
    # rule 3: every cell a running cell may see
    todo = sorted(run)
    while todo:
        i = todo.pop()
        for j in deps[i]:
            if j not in run:
                run.add(j)
                todo.append(j)
    return run


def release_check_skips(released, source, is_answer, is_test) -> dict[int, str]:
    """``{cell index: why}`` for the code cells of ``released`` (a notebook) that need not run in
    its check: the same in ``source`` (matched by nbgrader grade_id, or by position and source),
    and neither needed by nor downstream of an answer or test cell. ``is_answer``/``is_test`` tell
    the cells apart (``llmu.course.is_solution`` and ``llmu.course.is_test``)."""
    code = [(i, c) for i, c in enumerate(released.cells) if c.cell_type == "code"]
    src_code = [c for c in source.cells if c.cell_type == "code"]
    by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in src_code}
    by_id.pop(None, None)
    seeds = set()
    for k, (_, cell) in enumerate(code):
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        twin = by_id.get(gid) if gid else (src_code[k] if k < len(src_code) else None)
        if is_answer(cell) or is_test(cell) or twin is None or twin.source != cell.source:
            seeds.add(k)
    raising = {k for k, (_, cell) in enumerate(code) if is_test(cell)}
    run = cells_to_run([c.source for _, c in code], seeds, raising)
    return {i: "the instructor's cell, reading nothing the exercises bind; it ran in the instructor's run"
            for k, (i, _) in enumerate(code) if k not in run}
