"""The workloads of bench.bench_grounded, offline and written here: prompts whose answers copy from
their input (where model-free drafts, prompt lookup and a suffix cache, should pay) and open-ended
ones (where they should not cost anything).

    grounded    one chat turn whose answer restates its input: code edits (type hints, logging,
                const/let) and renames that print the whole code again, extraction (quote the
                sentences that mention X), summaries reusing the passage's wording, RAG answers
                from a given context, YAML → JSON and JSON → YAML
    multiturn   a chat whose last answer repeats an earlier assistant turn ("now print the full
                corrected program")
    agent       an agent loop: one family per file, the same system prompt (tool protocol) and
                file every turn, a different small instruction each turn, the answer a
                <write_file> call holding the whole updated file; turns run in order, so a
                suffix cache of recent requests warms up over a family
    open        bench_mixed's categories (HumanEval code, MT-bench chat, prose), loaded there

Every chat prompt is a list of messages (specdec.generation.ChatMessage); the harness renders it
with the target tokenizer's chat template (plain "role: content" lines where it has none). Items
carry the input an answer should copy from (`grounding`) and, where the answer is mechanical
(reformatting, renames, extraction), the `expected` answer, so the tests can check that the
prompts are grounded. The YAML and JSON texts are made from one Python value each (to_yaml,
json.dumps), so the pairs agree exactly.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass, field

from specdec.generation import ChatMessage

WORKLOADS = ("grounded", "multiturn", "agent", "open")
GROUNDED_KINDS = ("code-edit", "rename", "extract", "summary", "rag", "yaml2json", "json2yaml")


@dataclass(frozen=True)
class Item:
    """One prompt of a workload. Chat prompts have `messages`; plain-text prompts (HumanEval, prose)
    have `text`. Agent turns share `family` and count `turn` from 0."""

    id: str
    workload: str
    kind: str
    messages: tuple[ChatMessage, ...] = ()
    text: str | None = None
    grounding: str = ""  # the input text the answer should copy from
    expected: str | None = None  # the answer, where it is mechanical
    family: str | None = None
    turn: int = 0
    meta: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def chat(self) -> bool:
        return bool(self.messages)


def _d(text: str) -> str:
    return textwrap.dedent(text).strip("\n") + "\n"


def _user(content: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage("user", content),)


# ----------------------------------------------------------------------------------------------
# YAML (a small emitter: dicts, lists and scalars, block style, so the pairs need no library)
# ----------------------------------------------------------------------------------------------
_PLAIN = re.compile(r"^[A-Za-z_/.$][A-Za-z0-9_ ./@()+$-]*$")
_RESERVED = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"}


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _RESERVED and not text.endswith(" "):
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def _yaml_lines(value: object, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{_scalar(key)}:")
                lines += _yaml_lines(item, indent + 2)
            else:
                lines.append(f"{pad}{_scalar(key)}: {_scalar(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item:
                inner = _yaml_lines(item, indent + 2)
                inner[0] = f"{pad}- {inner[0][indent + 2:]}"
                lines += inner
            elif isinstance(item, list) and item:
                lines.append(f"{pad}-")
                lines += _yaml_lines(item, indent + 2)
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    else:
        lines.append(pad + _scalar(value))
    return lines


def to_yaml(value: object) -> str:
    """Block-style YAML of a JSON-like value (what yaml.safe_load reads back as the same value)."""
    return "\n".join(_yaml_lines(value, 0)) + "\n"


def to_json(value: object) -> str:
    return json.dumps(value, indent=2) + "\n"


# ----------------------------------------------------------------------------------------------
# grounded: code edits and renames
# ----------------------------------------------------------------------------------------------
INVENTORY = _d('''
    import json
    from dataclasses import dataclass, field


    @dataclass
    class Item:
        sku: str
        name: str
        price: float
        qty: int = 0
        tags: list = field(default_factory=list)


    def load_items(path):
        with open(path) as f:
            rows = json.load(f)
        return [Item(**row) for row in rows]


    def total_value(items):
        return sum(item.price * item.qty for item in items)


    def find_by_tag(items, tag):
        return [item for item in items if tag in item.tags]


    def restock(items, sku, amount):
        for item in items:
            if item.sku == sku:
                item.qty += amount
                return item
        raise KeyError(sku)


    def low_stock(items, threshold=5):
        return sorted((item for item in items if item.qty < threshold), key=lambda item: item.qty)


    def report(items):
        lines = [f"{item.sku:<8} {item.name:<24} {item.qty:>5} {item.price:>8.2f}" for item in items]
        lines.append(f"total value: {total_value(items):.2f}")
        return "\\n".join(lines)
''')

BACKUP = _d('''
    import os
    import shutil
    import sys
    import time


    def list_sources(root, extensions):
        found = []
        for directory, _, files in os.walk(root):
            for name in files:
                if os.path.splitext(name)[1] in extensions:
                    found.append(os.path.join(directory, name))
        print("found", len(found), "files under", root)
        return found


    def copy_all(paths, target):
        os.makedirs(target, exist_ok=True)
        copied = 0
        for path in paths:
            destination = os.path.join(target, os.path.basename(path))
            if os.path.exists(destination) and os.path.getmtime(destination) >= os.path.getmtime(path):
                print("skip", path)
                continue
            shutil.copy2(path, destination)
            copied += 1
        print("copied", copied, "of", len(paths), "files to", target)
        return copied


    def main(argv):
        if len(argv) != 3:
            print("usage: backup.py SOURCE TARGET")
            return 2
        started = time.time()
        paths = list_sources(argv[1], {".txt", ".md", ".csv"})
        copy_all(paths, argv[2])
        print("done in", round(time.time() - started, 2), "seconds")
        return 0


    if __name__ == "__main__":
        sys.exit(main(sys.argv))
''')

CART_JS = _d('''
    var TAX_RATE = 0.08;
    var FREE_SHIPPING_OVER = 50;

    function lineTotal(line) {
      var price = line.unitPrice * line.quantity;
      if (line.discount) {
        price = price - price * line.discount;
      }
      return Math.round(price * 100) / 100;
    }

    function subtotal(cart) {
      var sum = 0;
      for (var i = 0; i < cart.lines.length; i++) {
        sum += lineTotal(cart.lines[i]);
      }
      return sum;
    }

    function shipping(cart) {
      var base = subtotal(cart);
      if (base >= FREE_SHIPPING_OVER) {
        return 0;
      }
      var weight = 0;
      for (var i = 0; i < cart.lines.length; i++) {
        weight += cart.lines[i].weightKg * cart.lines[i].quantity;
      }
      return weight > 5 ? 12.5 : 4.99;
    }

    function total(cart) {
      var base = subtotal(cart);
      var tax = Math.round(base * TAX_RATE * 100) / 100;
      return base + tax + shipping(cart);
    }

    module.exports = { lineTotal, subtotal, shipping, total };
''')

STATS = _d('''
    def summarize(records):
        d = {}
        for r in records:
            key = r["customer"]
            if key not in d:
                d[key] = {"orders": 0, "spent": 0.0, "items": 0}
            d[key]["orders"] += 1
            d[key]["spent"] += r["amount"]
            d[key]["items"] += len(r["lines"])
        for key in d:
            d[key]["average"] = d[key]["spent"] / d[key]["orders"]
        return d


    def top_customers(records, n=3):
        d = summarize(records)
        ranked = sorted(d.items(), key=lambda pair: pair[1]["spent"], reverse=True)
        return [name for name, _ in ranked[:n]]


    def print_summary(records):
        d = summarize(records)
        for key in sorted(d):
            row = d[key]
            print(f"{key:<20} {row['orders']:>4} {row['spent']:>10.2f} {row['average']:>8.2f}")
        print("customers:", len(d))
''')

SHIPPING = _d('''
    class Order:
        def __init__(self, order_id, weight_kg, country, express=False):
            self.order_id = order_id
            self.weight_kg = weight_kg
            self.country = country
            self.express = express

        def calc(self):
            base = 4.5 if self.country == "DE" else 9.0
            cost = base + 1.2 * self.weight_kg
            if self.express:
                cost *= 1.8
            return round(cost, 2)


    class Invoice:
        def __init__(self, orders):
            self.orders = orders

        def shipping_total(self):
            return round(sum(order.calc() for order in self.orders), 2)

        def most_expensive(self):
            return max(self.orders, key=lambda order: order.calc())

        def lines(self):
            return [f"{order.order_id}: {order.calc():.2f} EUR" for order in self.orders]


    def cheapest_country(orders):
        costs = {}
        for order in orders:
            costs.setdefault(order.country, []).append(order.calc())
        return min(costs, key=lambda country: sum(costs[country]) / len(costs[country]))
''')

SESSIONS_GO = _d('''
    package sessions

    import (
    \t"errors"
    \t"sync"
    \t"time"
    )

    type Session struct {
    \tID      string
    \tUserID  string
    \tExpires time.Time
    }

    type Store struct {
    \tmu    sync.Mutex
    \tusr   map[string][]*Session
    \tbyID  map[string]*Session
    \tttl   time.Duration
    }

    func NewStore(ttl time.Duration) *Store {
    \treturn &Store{usr: map[string][]*Session{}, byID: map[string]*Session{}, ttl: ttl}
    }

    func (s *Store) Create(id, userID string, now time.Time) *Session {
    \ts.mu.Lock()
    \tdefer s.mu.Unlock()
    \tsession := &Session{ID: id, UserID: userID, Expires: now.Add(s.ttl)}
    \ts.byID[id] = session
    \ts.usr[userID] = append(s.usr[userID], session)
    \treturn session
    }

    func (s *Store) Get(id string, now time.Time) (*Session, error) {
    \ts.mu.Lock()
    \tdefer s.mu.Unlock()
    \tsession, ok := s.byID[id]
    \tif !ok || now.After(session.Expires) {
    \t\treturn nil, errors.New("session not found or expired")
    \t}
    \treturn session, nil
    }

    func (s *Store) CountFor(userID string) int {
    \ts.mu.Lock()
    \tdefer s.mu.Unlock()
    \treturn len(s.usr[userID])
    }
''')


def _code_prompt(language: str, code: str, instruction: str) -> str:
    return f"{instruction}\n\n```{language}\n{code}```"


def _rename(code: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def _code_items() -> tuple[list[Item], list[Item]]:
    edits = [
        ("type-hints", "python", INVENTORY,
         "Add type hints to every function in this module (parameters and return values; use "
         "list[Item] for lists of items). Change nothing else. Reply with the complete updated module "
         "in one code block."),
        ("logging", "python", BACKUP,
         "Replace every print call in this script with a call on a module-level logger "
         "(logger = logging.getLogger(__name__), info level; usage errors at error level) and add the "
         "import. Keep everything else exactly as it is and print the whole file."),
        ("const-let", "javascript", CART_JS,
         "Modernise this file: use const for variables that are never reassigned and let for the "
         "others, and turn the for loops over cart.lines into for...of loops. Print the complete file."),
    ]
    renames = [
        ("d", "totals_by_customer", "python", STATS,
         "Rename the variable d to totals_by_customer in every function. Print the complete code."),
        ("calc", "shipping_cost", "python", SHIPPING,
         "Rename the method calc to shipping_cost and update every call site. Print the complete code."),
        ("usr", "sessionsByUser", "go", SESSIONS_GO,
         "Rename the field usr to sessionsByUser everywhere. Print the complete file."),
    ]
    edit_items = [
        Item(f"grounded/code-edit/{i}", "grounded", "code-edit", _user(_code_prompt(lang, code, text)),
             grounding=code, meta={"name": name})
        for i, (name, lang, code, text) in enumerate(edits)
    ]
    rename_items = [
        Item(f"grounded/rename/{i}", "grounded", "rename", _user(_code_prompt(lang, code, text)),
             grounding=code, expected=_rename(code, old, new), meta={"old": old, "new": new})
        for i, (old, new, lang, code, text) in enumerate(renames)
    ]
    return edit_items, rename_items


# ----------------------------------------------------------------------------------------------
# grounded: passages (extraction, summary) and RAG
# ----------------------------------------------------------------------------------------------
CANAL = _d('''
    The Grand Western Canal was begun in 1810 to link the river Exe with the Bristol Channel, but
    only its eastern section was ever finished. Engineers planned a level route along the hillside
    so that boats would need no locks on the main line. Where the ground fell away near Nynehead,
    they built seven vertical lifts instead of locks, a daring choice that saved water in a dry
    valley. Each lift raised a boat in a counterweighted tank, and a crew of two could work it in
    about three minutes. Traders at first praised the speed of the lifts compared with the long
    flights of locks on neighbouring canals. The chains wore out quickly, however, and by 1840 the
    company had added an inclined plane at Wellisford. Limestone and coal were the main cargoes,
    carried in tub boats that held eight tons each. Some boatmen still preferred the locks of the
    Bridgwater canal, where a broken chain could not strand a loaded boat halfway up a hill. A
    survey of 1836 estimated that a flight of locks at Nynehead would have needed more water than
    the feeders could supply in summer. The railway reached Tiverton in 1848 and took most of that
    traffic within a decade. In 1867 the canal company sold the western section to the railway,
    which drained it. The eastern section survived as a quiet water channel, kept in water by the
    same feeders that once topped up the locks at its junction with the Bridgwater canal. Today
    walkers follow the towpath for eleven miles, and the ruins of two lifts can still be seen in the
    woods below Nynehead.
''')

INCIDENT = _d('''
    At 09:12 UTC the checkout service began returning errors for about one request in five. The
    on-call engineer saw that requests timed out while waiting for the database, even though the
    application servers themselves were nearly idle. A deployment at 08:55 had changed the order
    history page to load every past order of a customer instead of the latest twenty. For a few
    large customers this query read more than a hundred thousand rows and held its connection for
    several seconds. The connection pool of the database has sixty connections, and these slow
    queries kept most of them busy during the morning peak. Other requests, including checkout,
    queued for a free connection and gave up after two seconds. Dashboards showed the CPU of the
    database at only forty percent, which delayed the diagnosis by about ten minutes. The team
    rolled back the deployment at 09:41, and error rates returned to normal within four minutes. No
    orders were lost, because the payment provider retries failed callbacks for an hour. After the
    rollback the team checked the slow query log of the database and confirmed that the order
    history query had caused the contention. Follow-up work: add a limit to the order history query,
    alert when the pool of the database is more than eighty percent busy for five minutes, and give
    checkout its own small pool so that reporting pages cannot starve it. The incident lasted
    twenty-nine minutes and affected roughly 4,300 checkout attempts.
''')

REEF = _d('''
    Coral reefs cover less than one percent of the ocean floor, yet they shelter about a quarter of
    all known marine species. Reef-building corals live in partnership with algae that grow inside
    their tissues and supply most of their food through photosynthesis. This partnership is
    sensitive to water temperature, and a rise of only one degree above the usual summer maximum
    can break it. When that happens the corals expel their algae and turn white, a process known as
    bleaching. Bleached corals are not dead, but they starve slowly and become vulnerable to
    disease. If the temperature falls back within a few weeks, many colonies recover their algae
    and their colour. During the 2016 heat wave, water temperature on the northern Great Barrier Reef
    stayed above the bleaching threshold for more than eight weeks. Corals that survive repeated
    bleaching may host algae that tolerate a higher temperature, but they usually grow more slowly.
    Reefs also suffer from sediment washed off farmland, which blocks the light
    the algae need. Fishing with explosives destroys in seconds structures that took centuries to
    grow. Scientists now track sea surface temperature from satellites to warn reef managers weeks
    before a bleaching event. Some managers respond by shading small nurseries or by moving
    heat-tolerant corals onto damaged reefs. Such measures help locally, but researchers agree that
    the long-term future of reefs depends on limiting the global rise in ocean temperature.
''')

STATUS_REPORT = _d('''
    Project Atlas status, week 14. The migration of the billing service to the new cluster is
    ninety percent complete: all read traffic now runs on the new cluster, and write traffic will
    follow after the load test on Thursday. The load test must show a p99 latency below 250
    milliseconds at twice the current peak, otherwise the cut-over moves to the following week.
    The data team finished the backfill of invoices from 2019 to 2021, which took three days
    longer than planned because of duplicate customer records. They merged 1,842 duplicates and
    documented the rules they used in the shared wiki. Two risks remain open. First, the old
    cluster's certificates expire on May 30, so the cut-over cannot slip by more than two weeks.
    Second, the finance team still relies on a nightly export from the old database; Priya is
    rewriting that export against the new schema and expects to finish by Friday. Hiring: the
    second backend position is filled, and Marco starts on Monday. Budget: we are four percent
    under plan, mostly because the new cluster uses smaller instances than estimated. Next week the
    team will run the load test, switch write traffic if it passes, and retire the old cluster's
    batch jobs one by one.
''')

HEAT_ISLAND = _d('''
    Cities are often several degrees warmer than the countryside around them, an effect known as
    the urban heat island. Dark roofs and asphalt absorb sunlight during the day and release the
    heat slowly at night, so city nights cool much less than rural ones. Buildings block the wind
    that would carry heat away, and air conditioners pump even more heat into the streets. The
    difference matters most during heat waves, when warm nights prevent the body from recovering
    and hospital admissions rise among older residents. Several cities now paint roofs white or
    cover them with plants, which can lower roof temperatures by more than twenty degrees. Trees
    along streets cool the air through shade and through the water they evaporate, and a
    neighbourhood with many trees can be two or three degrees cooler than one without. Some cities
    have replaced asphalt playgrounds with grass and open water, and others map the hottest blocks
    to decide where to plant first. Planners warn that cooling measures must reach poorer
    neighbourhoods, which tend to have fewer trees and more asphalt, and where fewer households can
    afford air conditioning.
''')

RELEASE_NOTES = _d('''
    Version 3.2 of the Harbor command-line client is a maintenance release with one new feature.
    The new sync command copies a local folder to a bucket and uploads only the files that changed,
    comparing sizes and checksums instead of timestamps. Uploads larger than 64 megabytes are now
    split into parts that are sent in parallel, which makes large transfers up to three times faster
    on fast connections. The client now reads proxy settings from the HTTPS_PROXY environment
    variable, as most command-line tools do. Several bugs are fixed: the list command no longer
    stops after 1,000 objects, deleting a folder no longer leaves empty placeholder objects behind,
    and error messages for expired credentials now say which profile was used. The login command
    stores tokens in the operating system's keychain when one is available, instead of a plain text
    file. Support for Python 3.8 ends with this release; version 3.3 will require Python 3.9 or
    newer. The deprecated --no-verify flag still works but prints a warning and will be removed in
    version 4.0. Users upgrading from 3.0 should run harbor config migrate once to convert their
    profiles to the new format.
''')

SENTENCE = re.compile(r"[^.!?]+[.!?]")


def sentences(passage: str) -> list[str]:
    """The passage's sentences, each on one line (the passage's line breaks are spaces)."""
    flat = " ".join(passage.split())
    return [s.strip() for s in SENTENCE.findall(flat)]


def _passage_items() -> tuple[list[Item], list[Item]]:
    extracts = [("locks", CANAL), ("the database", INCIDENT), ("temperature", REEF)]
    extract_items = []
    for i, (topic, passage) in enumerate(extracts):
        quoted = [s for s in sentences(passage) if topic in s.lower()]
        prompt = (f"Quote, word for word, every sentence of the passage below that mentions {topic}. "
                  "Put each sentence on its own line, in the order they appear, with no other text.\n\n"
                  f"Passage:\n{passage}")
        extract_items.append(Item(f"grounded/extract/{i}", "grounded", "extract", _user(prompt),
                                  grounding=passage, expected="\n".join(quoted) + "\n",
                                  meta={"topic": topic}))
    summaries = [STATUS_REPORT, HEAT_ISLAND, RELEASE_NOTES]
    summary_items = [
        Item(f"grounded/summary/{i}", "grounded", "summary",
             _user("Summarize the following text in six bullet points. Reuse the text's own wording "
                   f"where you can and keep every number and name.\n\n{passage}"),
             grounding=passage)
        for i, passage in enumerate(summaries)
    ]
    return extract_items, summary_items


RAG_SETS = [
    (
        [
            ("Returns policy", "Most items can be returned within 30 days of delivery for a full refund. "
             "Items must be in their original packaging and include all accessories. Refunds are paid to "
             "the original payment method within five business days after the returned item arrives at "
             "our warehouse."),
            ("Audio products", "Headphones and earbuds can be returned within 30 days only if the "
             "hygiene seal is unbroken. Opened headphones can be exchanged for the same model within 14 "
             "days if they are faulty, but they cannot be refunded. Speakers follow the standard "
             "returns policy."),
            ("Damaged deliveries", "If an item arrives damaged, report it within 48 hours with a photo "
             "of the packaging. We send a replacement at no cost, or refund the item if no replacement "
             "is in stock. Do not throw away the packaging until the claim is closed."),
        ],
        "I opened a pair of headphones 20 days ago and one earbud crackles. Can I get my money back, "
        "and if not, what can I do?",
    ),
    (
        [
            ("Rate limits", "Each API key may send 600 requests per minute and 20 requests per second. "
             "Requests above either limit receive HTTP status 429 Too Many Requests. The response "
             "carries a Retry-After header with the number of seconds to wait before the next request."),
            ("Retries", "Clients should retry 429 and 503 responses with exponential backoff, starting "
             "at the Retry-After value when present and otherwise at one second, doubling the delay "
             "after each failure up to 60 seconds. Requests that create resources must send an "
             "Idempotency-Key header so that a retried request is not applied twice."),
            ("Quotas", "Monthly quotas are separate from rate limits. When a monthly quota is used up "
             "the API answers with status 402 until the next billing period starts or the plan is "
             "upgraded. Quota usage is shown on the billing page and in the X-Quota-Remaining header."),
        ],
        "My batch job sends bursts of 50 requests per second and some of them fail. What status do "
        "they get, and how should the job retry without creating duplicate orders?",
    ),
    (
        [
            ("On-call rotation", "The platform team runs a weekly on-call rotation that starts every "
             "Monday at 10:00 Berlin time. The primary on-call engineer answers pages within 15 "
             "minutes; the secondary takes over if the primary does not acknowledge within 30 minutes."),
            ("Severity levels", "Severity 1 means customers cannot log in, pay or reach the API; page "
             "the primary on-call engineer immediately and open an incident channel. Severity 2 means a "
             "feature is degraded for some customers; page during working hours only. Severity 3 issues "
             "go to the team's ticket queue."),
            ("Escalation", "If a severity 1 incident is not mitigated within one hour, the on-call "
             "engineer must page the engineering manager on duty, who decides whether to inform "
             "customers on the status page. Database incidents also involve the data team's on-call "
             "engineer."),
        ],
        "It is Saturday night and customers cannot pay because the payments database is down. Who "
        "should I page, and what happens if it is still broken after an hour?",
    ),
]


def _rag_items() -> list[Item]:
    items = []
    for i, (documents, question) in enumerate(RAG_SETS):
        context = "\n\n".join(f"[{n}] {title}\n{body}" for n, (title, body) in enumerate(documents, 1))
        prompt = ("Answer the question using only the context below. Quote the sentences you rely on "
                  "and cite each like [2].\n\n"
                  f"Context:\n{context}\n\nQuestion: {question}")
        items.append(Item(f"grounded/rag/{i}", "grounded", "rag", _user(prompt), grounding=context))
    return items


# ----------------------------------------------------------------------------------------------
# grounded: reformatting
# ----------------------------------------------------------------------------------------------
DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "orders-api", "namespace": "shop",
                 "labels": {"app": "orders-api", "tier": "backend"}},
    "spec": {
        "replicas": 3,
        "selector": {"matchLabels": {"app": "orders-api"}},
        "template": {
            "metadata": {"labels": {"app": "orders-api", "tier": "backend"}},
            "spec": {
                "containers": [
                    {
                        "name": "api",
                        "image": "registry.example.com/shop/orders-api:2.14.1",
                        "ports": [{"containerPort": 8080, "name": "http"}],
                        "env": [
                            {"name": "DATABASE_URL", "value": "postgres://orders-db:5432/orders"},
                            {"name": "LOG_LEVEL", "value": "info"},
                            {"name": "CACHE_TTL_SECONDS", "value": "300"},
                        ],
                        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                                      "limits": {"cpu": "1", "memory": "512Mi"}},
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080},
                                           "periodSeconds": 10},
                    }
                ]
            },
        },
    },
}

PIPELINE = {
    "name": "ci",
    "on": {"push": {"branches": ["main", "release/*"]}, "pull_request": {"branches": ["main"]}},
    "jobs": {
        "test": {
            "runs-on": "ubuntu-latest",
            "strategy": {"matrix": {"python": ["3.10", "3.11", "3.12"]}},
            "steps": [
                {"uses": "actions/checkout@v4"},
                {"uses": "actions/setup-python@v5", "with": {"python-version": "${{ matrix.python }}"}},
                {"run": "pip install -e .[test]"},
                {"run": "pytest -q --maxfail 1"},
            ],
        },
        "lint": {
            "runs-on": "ubuntu-latest",
            "steps": [
                {"uses": "actions/checkout@v4"},
                {"run": "pip install ruff mypy"},
                {"run": "ruff check ."},
                {"run": "mypy src"},
            ],
        },
        "publish": {
            "needs": ["test", "lint"],
            "if": "github.ref == 'refs/heads/main'",
            "runs-on": "ubuntu-latest",
            "steps": [{"uses": "actions/checkout@v4"}, {"run": "python -m build"},
                      {"run": "twine upload dist/*", "env": {"TWINE_TOKEN": "${{ secrets.PYPI_TOKEN }}"}}],
        },
    },
}

SETTINGS = {
    "service": "notifications",
    "version": 7,
    "debug": False,
    "server": {"host": "0.0.0.0", "port": 8443, "workers": 4, "timeout_seconds": 30},
    "channels": [
        {"name": "email", "enabled": True, "provider": "smtp", "rate_per_minute": 120,
         "retry": {"attempts": 5, "backoff_seconds": 2.5}},
        {"name": "sms", "enabled": True, "provider": "twilio", "rate_per_minute": 30,
         "retry": {"attempts": 3, "backoff_seconds": 10}},
        {"name": "push", "enabled": False, "provider": "firebase", "rate_per_minute": 600,
         "retry": {"attempts": 2, "backoff_seconds": 1}},
    ],
    "templates": {"welcome": "templates/welcome.html", "password_reset": "templates/reset.html",
                  "invoice": "templates/invoice.html"},
    "quiet_hours": {"start": "22:00", "end": "07:00", "timezone": "Europe/Berlin"},
}

MANIFEST = {
    "name": "@acme/dashboard",
    "version": "4.3.0",
    "private": True,
    "description": "Internal dashboard for the operations team",
    "scripts": {"dev": "vite", "build": "tsc -b && vite build", "test": "vitest run",
                "lint": "eslint src --max-warnings 0", "preview": "vite preview --port 4173"},
    "dependencies": {"react": "^18.3.1", "react-dom": "^18.3.1", "react-router-dom": "^6.26.0",
                     "@tanstack/react-query": "^5.51.1", "zod": "^3.23.8", "date-fns": "^3.6.0"},
    "devDependencies": {"typescript": "^5.5.4", "vite": "^5.4.0", "vitest": "^2.0.5",
                        "eslint": "^9.9.0", "@types/react": "^18.3.3"},
    "engines": {"node": ">=20"},
}

USERS = {
    "users": [
        {"id": 101, "name": "Amara Okafor", "email": "amara@example.org", "roles": ["admin", "billing"],
         "active": True, "last_login": "2024-05-02T08:14:00Z"},
        {"id": 102, "name": "Jonas Weber", "email": "jonas@example.org", "roles": ["developer"],
         "active": True, "last_login": "2024-05-01T17:45:12Z"},
        {"id": 103, "name": "Li Wei", "email": "li.wei@example.org", "roles": ["developer", "on-call"],
         "active": False, "last_login": None},
        {"id": 104, "name": "Sofia Rossi", "email": "sofia@example.org", "roles": ["support"],
         "active": True, "last_login": "2024-04-28T09:03:41Z"},
    ],
    "groups": {"admins": [101], "engineering": [102, 103], "support": [104]},
    "updated_by": "sync-job",
}

OPENAPI = {
    "openapi": "3.0.3",
    "info": {"title": "Orders API", "version": "2.14.1"},
    "paths": {
        "/orders": {
            "get": {"summary": "List orders", "parameters": [
                {"name": "status", "in": "query", "required": False, "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "maximum": 100}}],
                    "responses": {"200": {"description": "A page of orders"}}},
            "post": {"summary": "Create an order",
                     "responses": {"201": {"description": "Created"}, "409": {"description": "Duplicate"}}},
        },
        "/orders/{id}": {
            "get": {"summary": "Get one order", "parameters": [
                {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {"200": {"description": "The order"}, "404": {"description": "Not found"}}},
        },
    },
}


def _reformat_items() -> tuple[list[Item], list[Item]]:
    to_json_items = []
    for i, value in enumerate([DEPLOYMENT, PIPELINE, SETTINGS]):
        source = to_yaml(value)
        prompt = ("Convert this YAML document to JSON with 2-space indentation, keeping the key order. "
                  f"Output only the JSON.\n\n```yaml\n{source}```")
        to_json_items.append(Item(f"grounded/yaml2json/{i}", "grounded", "yaml2json", _user(prompt),
                                  grounding=source, expected=to_json(value)))
    to_yaml_items = []
    for i, value in enumerate([MANIFEST, USERS, OPENAPI]):
        source = to_json(value)
        prompt = ("Convert this JSON document to YAML (block style, 2-space indentation), keeping the key "
                  f"order. Output only the YAML.\n\n```json\n{source}```")
        to_yaml_items.append(Item(f"grounded/json2yaml/{i}", "grounded", "json2yaml", _user(prompt),
                                  grounding=source, expected=to_yaml(value)))
    return to_json_items, to_yaml_items


def grounded_items(per_kind: int) -> list[Item]:
    """`per_kind` prompts of each kind in GROUNDED_KINDS (at most 3), in that order."""
    edits, renames = _code_items()
    extracts, summaries = _passage_items()
    to_json_items, to_yaml_items = _reformat_items()
    by_kind = {"code-edit": edits, "rename": renames, "extract": extracts, "summary": summaries,
               "rag": _rag_items(), "yaml2json": to_json_items, "json2yaml": to_yaml_items}
    return [item for kind in GROUNDED_KINDS for item in by_kind[kind][:per_kind]]


# ----------------------------------------------------------------------------------------------
# multi-turn: the last answer repeats an earlier assistant turn
# ----------------------------------------------------------------------------------------------
CSV_PROGRAM = _d('''
    import csv
    import sys
    from collections import defaultdict


    def read_orders(path):
        with open(path, newline="") as f:
            return list(csv.DictReader(f))


    def revenue_by_month(orders):
        totals = defaultdict(float)
        for order in orders:
            month = order["date"][:7]
            totals[month] += float(order["price"]) * int(order["quantity"])
        return dict(sorted(totals.items()))


    def best_month(totals):
        return max(totals, key=totals.get)


    def main():
        orders = read_orders(sys.argv[1])
        totals = revenue_by_month(orders)
        for month, total in totals.items():
            print(f"{month}: {total:.2f}")
        print("best month:", best_month(totals))


    if __name__ == "__main__":
        main()
''')

EMAIL = _d('''
    Hi Dana,

    Thanks for sending over the draft contract yesterday. We went through it with our legal team
    this morning and we're mostly happy with it. There are three things we'd like to change:

    1. The payment terms: we'd like 45 days instead of 30, since our finance team pays invoices
       twice a month.
    2. The support hours: the draft says 9 to 5 CET, but half of our users are in New York, so we'd
       need coverage until 8 pm CET on weekdays.
    3. The termination clause: we'd like the notice period to be 60 days for both sides, not 90
       days for us and 30 days for you.

    Everything else looks good to us, including the price and the start date of June 1. If you can
    send an updated version by Friday, we can sign next week.

    Cheers,
    Tom
''')

NGINX = _d('''
    server {
        listen 80;
        server_name shop.example.com;
        return 301 https://$host$request_uri;
    }

    server {
        listen 443 ssl;
        server_name shop.example.com;

        ssl_certificate     /etc/ssl/shop/fullchain.pem;
        ssl_certificate_key /etc/ssl/shop/privkey.pem;

        client_max_body_size 10m;

        location /api/ {
            proxy_pass http://127.0.0.1:8080/;
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_read_timeout 30s;
        }

        location /static/ {
            root /srv/shop;
            expires 7d;
        }

        location / {
            root /srv/shop/app;
            try_files $uri /index.html;
        }
    }
''')

MULTITURN = [
    (
        "Write a Python script that reads a CSV of orders (columns date, price, quantity) and prints "
        "the revenue per month and the best month.",
        f"Here is a script that does that:\n\n```python\n{CSV_PROGRAM}```\n\nRun it as "
        "`python revenue.py orders.csv`.",
        "It crashes on rows where quantity is empty. Skip those rows, and also skip rows whose price "
        "is not a number. Now print the full corrected program.",
        CSV_PROGRAM,
    ),
    (
        "Can you help me write an email to Dana asking for three changes to the contract: payment in "
        "45 days, support until 8 pm CET, and a 60-day notice period for both sides?",
        f"Sure, here is a draft:\n\n{EMAIL}",
        "Good. Make the tone a little more formal and sign it as Tom Becker, Head of Operations, but "
        "keep the content and structure the same. Print the whole email again.",
        EMAIL,
    ),
    (
        "Write an nginx config for shop.example.com that redirects HTTP to HTTPS, proxies /api/ to a "
        "backend on port 8080 and serves static files.",
        f"Here you go:\n\n```nginx\n{NGINX}```\n\nReload nginx with `nginx -s reload` after saving it.",
        "The backend moved to port 9090 and we need gzip on for the static files. Print the complete "
        "updated config.",
        NGINX,
    ),
]


def multiturn_items(per_kind: int) -> list[Item]:
    items = []
    for i, (ask, answer, follow_up, repeated) in enumerate(MULTITURN[:per_kind]):
        messages = (ChatMessage("user", ask), ChatMessage("assistant", answer),
                    ChatMessage("user", follow_up))
        items.append(Item(f"multiturn/{i}", "multiturn", "repeat", messages, grounding=repeated))
    return items


# ----------------------------------------------------------------------------------------------
# agent loop: the same system prompt and file, a different small instruction per turn
# ----------------------------------------------------------------------------------------------
AGENT_SYSTEM = _d('''
    You are a coding agent working in a repository. You act only through tools. To call a tool,
    reply with exactly one XML block and nothing else. Available tools:

    <read_file>
    <path>relative/path.py</path>
    </read_file>
    Reads a file. Use it only for files whose content you have not been given.

    <write_file>
    <path>relative/path.py</path>
    <content>
    the complete new content of the file
    </content>
    </write_file>
    Replaces a file with the given content. Always write the whole file, never a fragment or a diff.

    <run_tests>
    <path>tests/</path>
    </run_tests>
    Runs the test suite under the given path and returns its output.

    Rules: keep the existing style, change only what the task asks for, and never remove code that
    the task does not mention.
''')

AGENT_FAMILIES = [
    ("inventory.py", "python", INVENTORY, [
        "Add a docstring to restock that says it raises KeyError for an unknown sku.",
        "Make total_value round its result to two decimal places.",
        "Give low_stock a default threshold of 10 instead of 5.",
        "Make find_by_tag compare tags case-insensitively.",
    ]),
    ("backup.py", "python", BACKUP, [
        "Add .json to the file extensions that list_sources collects in main.",
        "Make copy_all return the list of copied paths instead of their number.",
        "Exit with status 1 from main when no source files are found.",
        "Print the elapsed time with one decimal place instead of two.",
    ]),
    ("cart.js", "javascript", CART_JS, [
        "Raise FREE_SHIPPING_OVER to 75.",
        "Make shipping return 15 instead of 12.5 for carts over 5 kg.",
        "Round the result of total to two decimal places.",
        "Export TAX_RATE as well.",
    ]),
]


def agent_families(per_kind: int) -> list[list[Item]]:
    """`per_kind` families (at most 3), each its turns in order."""
    families = []
    for f, (path, language, code, tasks) in enumerate(AGENT_FAMILIES[:per_kind]):
        turns = []
        for t, task in enumerate(tasks):
            user = (f"File {path}:\n\n```{language}\n{code}```\n\nTask: {task} Reply with a single "
                    f"<write_file> call for {path} holding the complete updated file.")
            messages = (ChatMessage("system", AGENT_SYSTEM), ChatMessage("user", user))
            turns.append(Item(f"agent/{f}/{t}", "agent", "agent", messages, grounding=code,
                              family=f"agent/{f}", turn=t, meta={"path": path}))
        families.append(turns)
    return families


# ----------------------------------------------------------------------------------------------
# open-ended: bench_mixed's categories
# ----------------------------------------------------------------------------------------------
def open_items(per_kind: int) -> list[Item]:
    """bench_mixed.category_prompts: HumanEval stubs and prose as plain text, MT-bench as chat."""
    from bench.bench_mixed import category_prompts

    items = []
    for category, prompts in category_prompts(per_kind).items():
        for i, prompt in enumerate(prompts):
            if prompt.chat:
                items.append(Item(f"open/{category}/{i}", "open", category, _user(prompt.text)))
            else:
                items.append(Item(f"open/{category}/{i}", "open", category, text=prompt.text))
    return items


def workload_items(workloads: list[str] | tuple[str, ...], per_kind: int) -> dict[str, list[Item]]:
    """Every selected workload's items, in order (agent: the families' turns one after another)."""
    out: dict[str, list[Item]] = {}
    for workload in workloads:
        if workload == "grounded":
            out[workload] = grounded_items(per_kind)
        elif workload == "multiturn":
            out[workload] = multiturn_items(per_kind)
        elif workload == "agent":
            out[workload] = [turn for family in agent_families(per_kind) for turn in family]
        elif workload == "open":
            out[workload] = open_items(per_kind)
        else:
            raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    return out


# ----------------------------------------------------------------------------------------------
# rendering
# ----------------------------------------------------------------------------------------------
def render_text(item: Item, tokenizer) -> str:
    """The prompt as text: the chat template's rendering (ending with the assistant's turn), or
    "role: content" blocks where the tokenizer has no template, or the plain text."""
    if not item.chat:
        assert item.text is not None
        return item.text
    messages = [{"role": m.role, "content": m.content} for m in item.messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def prompt_ids(item: Item, tokenizer, max_tokens: int = 1024) -> list[int]:
    """The item's token ids for the target's tokenizer (as specdec.prompts.prompt_ids: no special
    tokens added, long prompts keep their last `max_tokens` tokens)."""
    ids = list(tokenizer(render_text(item, tokenizer), add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"prompt {item.id} tokenizes to nothing")
    return ids[-max_tokens:]
