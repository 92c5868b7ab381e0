"""R-Search NL-DAG (multi-source search plans): `<think>`, then one `<search>` holding a natural-language DAG,
then `<result>` (inserted, masked), then `<answer>`.

The plan, as in the paper's Figure 4:

    <search> Nodes: A: Price fluctuation of coke in early October 2024 (News)
    B: Impact of global energy market on coke prices (News)
    C: International coke market dynamics in early October 2024 (News)
    Edges: A -> C; B -> C </search>

Each node is `ID: query (Tool)`; edges `X -> Y` (chains `X -> Y -> Z` allowed) separated by `;`, `,` or lines.
The plan is validated (node format, node limit, known tools, edges between defined nodes, acyclicity); nodes
naming an unknown tool are flagged and excluded, as the paper does. Execution runs topological layers in order,
the nodes of one layer in parallel (asyncio.gather); each tool maps to a search source through the SearchFn's
`source` argument (default "Wiki" -> local, "Web" -> web, "News" -> news, "ArXiv" -> arxiv). Results are
prefixed by their node id: `Node A (News) Search results:\\nResult 1:\\nTitle: …\\nAbstract: …`.

    proto = NLDagProtocol(tools={"Wiki": "local"}, max_nodes=8)
    plan = parse_dag(text, proto.tools, proto.max_nodes)   # DagPlan; plan.valid drives the DAG-validity reward
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from rsearch_verl.rollout.protocols.base import Action
from rsearch_verl.rollout.protocols.tagged import MAX_QUERY_CHARS, TagSearchProtocol
from rsearch_verl.search.client import SearchError
from rsearch_verl.search.types import SearchFn

DEFAULT_TOOLS = {"Wiki": "local", "Web": "web", "News": "news", "ArXiv": "arxiv"}
# other names the policy may use for the same tool (the paper's case study writes "news search (GNews)" etc.)
TOOL_ALIASES = {
    "wikipedia": "wiki",
    "local": "wiki",
    "general": "web",
    "google": "web",
    "gnews": "news",
    "academic": "arxiv",
    "paper": "arxiv",
    "papers": "arxiv",
}

_NODE_SPLIT = re.compile(r"(?:\n|;)\s*(?=[A-Z][0-9]*\s*:)")
_NODE = re.compile(r"^([A-Z][0-9]*)\s*:\s*(.*)\(([^()]*)\)\s*[.;,]?$", re.DOTALL)
_ARROW = re.compile(r"\s*(?:->|→|=>)\s*")


@dataclass
class DagNode:
    id: str
    query: str
    tool: str  # as the policy wrote it
    source: str | None  # the SearchFn source, None when the tool is unknown (node excluded)


@dataclass
class DagPlan:
    nodes: dict[str, DagNode] = field(default_factory=dict)
    edges: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # any error makes the plan invalid (DAG-validity reward 0)
    fatal: bool = False  # structurally broken (cycle, malformed, too many nodes): nothing is executed

    @property
    def valid(self) -> bool:
        return not self.errors

    def runnable(self) -> list[str]:
        return [n for n, node in self.nodes.items() if node.source is not None]

    def layers(self) -> list[list[str]]:
        """Topological layers of the runnable nodes (each layer's nodes depend only on earlier layers)."""
        keep = set(self.runnable())
        edges = [(a, b) for a, b in self.edges if a in keep and b in keep]
        return _kahn_layers([n for n in self.nodes if n in keep], edges)


def _kahn_layers(nodes: list[str], edges: list[tuple[str, str]]) -> list[list[str]]:
    """Kahn's algorithm by layers; nodes left over (on a cycle) are not returned."""
    indeg = dict.fromkeys(nodes, 0)
    children: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in set(edges):
        indeg[b] += 1
        children[a].append(b)
    layer = [n for n in nodes if indeg[n] == 0]
    layers = []
    while layer:
        layers.append(layer)
        nxt = []
        for n in layer:
            for c in children[n]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    nxt.append(c)
        layer = sorted(nxt, key=nodes.index)
    return layers


def _resolve_tool(tool: str, tools: dict[str, str]) -> str | None:
    by_lower = {name.lower(): source for name, source in tools.items()}
    key = tool.strip().lower()
    return by_lower.get(key, by_lower.get(TOOL_ALIASES.get(key, "")))


def _split_sections(text: str) -> tuple[str, str]:
    m_edges = re.search(r"\bedges\s*:", text, flags=re.IGNORECASE)
    nodes_part, edges_part = (text[: m_edges.start()], text[m_edges.end() :]) if m_edges else (text, "")
    m_nodes = re.search(r"\bnodes\s*:", nodes_part, flags=re.IGNORECASE)
    if m_nodes:
        nodes_part = nodes_part[m_nodes.end() :]
    return nodes_part.strip(), edges_part.strip()


def _parse_nodes(section: str, tools: dict[str, str], plan: DagPlan) -> None:
    for chunk in filter(None, (c.strip() for c in _NODE_SPLIT.split(section))):
        m = _NODE.match(chunk)
        if not m:
            plan.errors.append(f"malformed node {chunk[:60]!r} (expected 'A: query (Tool)')")
            plan.fatal = True
            continue
        node_id, query, tool = m.group(1), " ".join(m.group(2).split()), m.group(3).strip()
        if node_id in plan.nodes:
            plan.errors.append(f"duplicate node {node_id}")
            plan.fatal = True
            continue
        if not query:
            plan.errors.append(f"empty query in node {node_id}")
            plan.fatal = True
            continue
        source = _resolve_tool(tool, tools)
        if source is None:
            plan.errors.append(f"unknown tool {tool!r} in node {node_id} (known: {', '.join(tools)})")
        plan.nodes[node_id] = DagNode(node_id, query[:MAX_QUERY_CHARS], tool, source)


def _parse_edges(section: str, plan: DagPlan) -> None:
    for part in filter(None, (p.strip() for p in re.split(r"[;,\n]", section))):
        if part.lower().rstrip(".") in ("none", "n/a", "-", "no edges"):
            continue
        ids = [x.strip() for x in _ARROW.split(part)]
        if len(ids) < 2 or not all(ids):
            plan.errors.append(f"malformed edge {part[:40]!r} (expected 'A -> B')")
            plan.fatal = True
            continue
        for node_id in ids:
            if node_id not in plan.nodes:
                plan.errors.append(f"edge refers to undefined node {node_id!r}")
                plan.fatal = True
        plan.edges.extend(zip(ids[:-1], ids[1:], strict=True))


def parse_dag(text: str, tools: dict[str, str] | None = None, max_nodes: int = 8) -> DagPlan:
    """Parse and validate an NL-DAG (the content of one `<search>` block)."""
    tools = DEFAULT_TOOLS if tools is None else tools
    plan = DagPlan()
    nodes_part, edges_part = _split_sections(text)
    _parse_nodes(nodes_part, tools, plan)
    if not plan.nodes and not plan.errors:
        plan.errors.append("no nodes (expected 'Nodes: A: query (Tool)')")
        plan.fatal = True
    if len(plan.nodes) > max_nodes:
        plan.errors.append(f"too many nodes ({len(plan.nodes)} > {max_nodes})")
        plan.fatal = True
    _parse_edges(edges_part, plan)
    if not plan.fatal:
        ordered = sum(_kahn_layers(list(plan.nodes), plan.edges), [])
        if len(ordered) < len(plan.nodes):
            cyc = sorted(set(plan.nodes) - set(ordered))
            plan.errors.append(f"cycle among nodes {', '.join(cyc)}")
            plan.fatal = True
    return plan


def _system_prompt(tools: dict[str, str], max_nodes: int) -> str:
    return (
        "You are a helpful assistant that answers questions by reasoning and searching. First reason about the "
        "question inside <think> and </think>. Then write a search plan inside <search> and </search> as a "
        "natural-language directed acyclic graph: after 'Nodes:' list one node per line as 'ID: query (Tool)', "
        "where ID is a capital letter and Tool is one of: " + ", ".join(tools) + "; after 'Edges:' list "
        "dependencies as 'A -> B' separated by ';'. Use at most " + str(max_nodes) + " nodes. Independent nodes "
        "are searched in parallel. The search results are returned between <result> and </result>, each prefixed "
        "by its node ID. Finally, give the answer inside <answer> and </answer>. For example: <think> reasoning "
        "</think> <search> Nodes: A: first sub-query ("
        + next(iter(tools))
        + ")\nB: second sub-query ("
        + next(iter(tools))
        + ")\nEdges: A -> B </search> <result> ... </result> <answer> final answer </answer>"
    )


class NLDagProtocol(TagSearchProtocol):
    name = "nl_dag"
    stop_strings = ["</search>", "</answer>"]
    observation_open = "<result>"
    observation_close = "</result>"
    obs_prefix = "\n"
    obs_suffix = "\n"
    demo_format = ("<think> {t} </think>\n", "<search>\nA: {q} (Wiki)\n</search>", "<answer> {a} </answer>")

    def __init__(self, tools: dict[str, str] | None = None, max_nodes: int = 8):
        self.tools = dict(DEFAULT_TOOLS if tools is None else tools)
        if not self.tools or max_nodes < 1:
            raise ValueError("nl_dag needs at least one tool and max_nodes >= 1")
        self.max_nodes = max_nodes
        self.system_prompt = _system_prompt(self.tools, max_nodes)

    def _parse_query(self, body: str) -> Action:
        start = body.rfind(self.query_open)
        if start < 0:
            return Action(kind="invalid", error=f"{self.query_close} without {self.query_open}")
        plan = parse_dag(body[start + len(self.query_open) :], self.tools, self.max_nodes)
        if plan.fatal or not plan.runnable():
            return Action(kind="invalid", plan=plan, error="; ".join(plan.errors) or "no runnable node")
        queries = [plan.nodes[n].query for layer in plan.layers() for n in layer]
        return Action(kind="search", queries=queries, plan=plan)

    async def _run_node(self, node: DagNode, search: SearchFn, topk: int) -> str:
        head = f"Node {node.id} ({node.tool}) Search results:\n"
        try:
            docs = (await search([node.query], topk, node.source or ""))[0]
        except SearchError as exc:
            return head + f"search failed: {exc.short()}\n"
        if not docs:
            return head + self.empty_results + "\n"
        return head + "".join(
            f"Result {i}:\nTitle: {d.title}\nAbstract: {' '.join(d.text.split())}\n" for i, d in enumerate(docs, 1)
        )

    async def observe(self, action: Action, search: SearchFn, topk: int) -> str:
        if action.tool is not None:  # a tool of rollout.tools besides search (`<open> … </open>`, valid or not)
            return await super().observe(action, search, topk)
        if action.kind == "invalid":
            return self.wrap(
                f"Invalid search plan: {action.error}. Write 'Nodes: A: query (Tool)' and "
                "'Edges: A -> B' inside <search> </search>."
            )
        plan: DagPlan = action.plan
        if action.kind != "search" or plan is None:
            raise ValueError(f"observe() needs a parsed NL-DAG search action, got {action.kind!r}")
        parts = []
        for layer in plan.layers():  # layers in order; the nodes of one layer in parallel
            parts.extend(await asyncio.gather(*(self._run_node(plan.nodes[n], search, topk) for n in layer)))
        for node in plan.nodes.values():
            if node.source is None:
                parts.append(f"Node {node.id} ({node.tool}) skipped: unknown tool\n")
        return self.wrap("\n" + "\n".join(parts))
