//! The `sinkmerge reproduce` report in a real browser: headless Chromium driven over WebDriver (the
//! W3C protocol, spoken here over HTTP with ureq) opens `docs/reproduce-example.html`, or the
//! report `SINKMERGE_REPORT` names, and checks what a reader sees: no console warnings or errors,
//! nothing loaded from outside the file, every required section and figure drawn at a non-zero
//! size, every number of a table equal to its value in the summary JSON as rounded for display, a
//! screenshot that is not blank, no horizontal scrolling at 800 px, and a print stylesheet.
//!
//! Ignored by default (it needs chromium and chromedriver); `.ci/run` installs both and runs it
//! with `--ignored`, and there a missing chromedriver fails the test instead of skipping it.
//! `CHROMEDRIVER` and `CHROMIUM` override the two programs' paths.

use std::collections::HashMap;
use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::util::root;

/// The sections a report must have, and those of them that must hold at least one figure.
pub const SECTIONS: [&str; 7] = [
    "models",
    "drift",
    "merges",
    "curves",
    "heads",
    "predictor",
    "steps",
];
const SECTIONS_WITH_FIGURES: [&str; 5] = ["drift", "merges", "curves", "heads", "predictor"];

/// A screenshot is not blank when more than this share of its pixels differ from its most common
/// colour and it has at least this many colours (a page of text and plots has thousands).
const MIN_INK: f64 = 0.02;
const MIN_COLOURS: usize = 48;

/// How long chromedriver may take to answer `/status` as ready.
const STARTUP: Duration = Duration::from_secs(30);

/// A chromedriver process and its one browser session. Dropping it, panicking or not, ends the
/// session (which closes the browser) and kills chromedriver, so that no test run leaves them.
struct Driver {
    child: Child,
    agent: ureq::Agent,
    base: String,
    session: Option<String>,
    log_path: PathBuf,
    _log_dir: tempfile::TempDir,
}

impl Driver {
    /// Start chromedriver on a free port, wait until it is ready and open a headless session.
    fn start() -> Driver {
        let program = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let browser = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        // The port is free when asked; chromedriver takes it a moment later, a race no other
        // test of this binary runs into.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("no free local port for chromedriver")
            .port();
        let log_dir = tempfile::tempdir().unwrap();
        let log_path = log_dir.path().join("chromedriver.log");
        let log = File::create(&log_path).unwrap();
        let child = Command::new(&program)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start chromedriver `{program}`: {e}. The browser test needs chromium \
                     and chromedriver (`apt-get install chromium chromium-driver`, as \
                     .ci/system-deps.sh does), or CHROMEDRIVER set to chromedriver's path"
                )
            });
        let mut driver = Driver {
            child,
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(120))
                .build(),
            base: format!("http://127.0.0.1:{port}"),
            session: None,
            log_path,
            _log_dir: log_dir,
        };
        driver.wait_ready(&program);
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": browser,
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--window-size=1280,900",
                ],
            },
            "goog:loggingPrefs": {"browser": "ALL", "performance": "ALL"},
        }}});
        let created = driver.request("POST", "/session", Some(&capabilities));
        let id = created["sessionId"].as_str().unwrap_or_else(|| {
            panic!("chromedriver answered a new session without an id: {created}")
        });
        driver.session = Some(id.to_string());
        driver
    }

    fn wait_ready(&mut self, program: &str) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "chromedriver `{program}` exited ({status}) before it was ready:\n{}",
                    self.log()
                );
            }
            let ready = self
                .agent
                .get(&format!("{}/status", self.base))
                .timeout(Duration::from_secs(2))
                .call()
                .ok()
                .and_then(|r| r.into_string().ok())
                .and_then(|body| serde_json::from_str::<Value>(&body).ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if ready {
                return;
            }
            if start.elapsed() > STARTUP {
                panic!(
                    "chromedriver `{program}` not ready after {STARTUP:?}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// One WebDriver request to a path of chromedriver; the answer's `value`, or a panic with
    /// the W3C error (and chromedriver's log when it says nothing useful).
    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let url = format!("{}{path}", self.base);
        let request = self.agent.request(method, &url);
        let answer = match body {
            Some(body) => request
                .set("Content-Type", "application/json")
                .send_string(&body.to_string()),
            None => request.call(),
        };
        let text = match answer {
            Ok(r) => r.into_string().unwrap(),
            Err(ureq::Error::Status(code, r)) => panic!(
                "WebDriver {method} {path} failed with HTTP {code}: {}",
                r.into_string().unwrap_or_default()
            ),
            Err(e) => panic!(
                "WebDriver {method} {path}: {e}\nchromedriver's log:\n{}",
                self.log()
            ),
        };
        let mut parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!("WebDriver {method} {path} answered non-JSON ({e}): {text}")
        });
        parsed["value"].take()
    }

    /// A request to a path of the session.
    fn session(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let id = self.session.as_deref().unwrap();
        self.request(method, &format!("/session/{id}{path}"), body)
    }

    /// Run `script` (a function body, given `args` as `arguments`) in the page; its return value.
    fn execute<T: DeserializeOwned>(&self, script: &str, args: Value) -> T {
        let value = self.session(
            "POST",
            "/execute/sync",
            Some(&json!({"script": script, "args": args})),
        );
        serde_json::from_value(value.clone())
            .unwrap_or_else(|e| panic!("the page's answer {value} is not what was expected: {e}"))
    }

    fn set_window(&self, width: u32, height: u32) {
        self.session(
            "POST",
            "/window/rect",
            Some(&json!({"width": width, "height": height})),
        );
    }

    /// The entries of one of chromedriver's logs ("browser", "performance") since the last read.
    /// `/se/log` is chromedriver's W3C-mode route for the legacy log command.
    fn log_entries(&self, kind: &str) -> Vec<LogEntry> {
        let value = self.session("POST", "/se/log", Some(&json!({"type": kind})));
        serde_json::from_value(value).unwrap()
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(id) = self.session.take() {
            let _ = self
                .agent
                .delete(&format!("{}/session/{id}", self.base))
                .call();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Deserialize)]
struct LogEntry {
    level: String,
    message: String,
}

/// What the page says about its structure, from [`LAYOUT_SCRIPT`].
#[derive(Deserialize)]
struct Layout {
    sections: Vec<Option<Section>>,
    figures: Vec<Figure>,
    tables: Vec<Table>,
    cells: Vec<Cell>,
    bare_cells: Vec<String>,
}

#[derive(Deserialize)]
struct Section {
    size: [f64; 2],
    figures: usize,
}

#[derive(Deserialize)]
struct Figure {
    section: Option<String>,
    size: [f64; 2],
    svg: Option<[f64; 2]>,
}

#[derive(Deserialize)]
struct Table {
    section: Option<String>,
    head_cells: usize,
}

#[derive(Deserialize)]
struct Cell {
    tag: String,
    key: String,
    text: String,
    section: Option<String>,
}

const LAYOUT_SCRIPT: &str = r#"
const size = e => { const r = e.getBoundingClientRect(); return [r.width, r.height]; };
const section = e => { const s = e.closest('section'); return s ? s.id : null; };
return {
  sections: arguments[0].map(id => {
    const s = document.getElementById(id);
    return s && s.tagName === 'SECTION'
      ? {size: size(s), figures: s.querySelectorAll('figure').length} : null;
  }),
  figures: [...document.querySelectorAll('figure')].map(f => {
    const svg = f.querySelector('svg');
    return {section: section(f), size: size(f), svg: svg ? size(svg) : null};
  }),
  tables: [...document.querySelectorAll('table')].map(t =>
    ({section: section(t), head_cells: t.querySelectorAll('thead th').length})),
  cells: [...document.querySelectorAll('[data-key]')].map(c =>
    ({tag: c.tagName, key: c.getAttribute('data-key'), text: c.innerText, section: section(c)})),
  bare_cells: [...document.querySelectorAll('td:not([data-key])')].map(c => c.innerText),
};
"#;

/// The page's width against its content's at the current window size; `wide` names the first
/// elements that reach past the viewport, to say what overflows.
#[derive(Deserialize)]
struct Overflow {
    inner_width: f64,
    document: [f64; 2],
    body: [f64; 2],
    wide: Vec<String>,
}

const OVERFLOW_SCRIPT: &str = r#"
const d = document.documentElement, b = document.body;
const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
  + (typeof e.className === 'string' && e.className ? '.' + e.className.split(/\s+/).join('.') : '');
return {
  inner_width: window.innerWidth,
  document: [d.scrollWidth, d.clientWidth],
  body: [b.scrollWidth, b.clientWidth],
  wide: [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > d.clientWidth + 1)
    .slice(0, 5)
    .map(e => name(e) + ' (right edge ' + Math.round(e.getBoundingClientRect().right) + ' px)'),
};
"#;

/// The report under test and its summary: `SINKMERGE_REPORT`'s path with `.html` replaced by
/// `.summary.json`, or the bundled example.
fn report_paths() -> (PathBuf, PathBuf) {
    let html = std::env::var_os("SINKMERGE_REPORT")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("docs/reproduce-example.html"));
    let html = std::fs::canonicalize(&html).unwrap_or_else(|e| {
        panic!(
            "the report {} cannot be read ({e}); `sinkmerge reproduce` writes it",
            html.display()
        )
    });
    let name = html.file_name().unwrap().to_string_lossy();
    let stem = name
        .strip_suffix(".html")
        .unwrap_or_else(|| panic!("the report {} does not end in .html", html.display()));
    let summary = html.with_file_name(format!("{stem}.summary.json"));
    (html, summary)
}

/// `path` as a file URL, its bytes outside the unreserved set percent-encoded.
fn file_url(path: &Path) -> String {
    let mut url = String::from("file://");
    for &b in path.to_str().expect("a UTF-8 path").as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            url.push(b as char);
        } else {
            url.push_str(&format!("%{b:02X}"));
        }
    }
    url
}

/// Whether a cell's `text` shows `value` from the summary as the report rounds it (integers
/// exactly, other numbers to the decimals shown, in scientific notation to those of the mantissa,
/// null as a dash); why not.
fn check_cell(text: &str, value: &Value) -> Result<(), String> {
    let text = text.trim();
    let dash = text == "-" || text == "–";
    match value {
        Value::Null if dash => Ok(()),
        Value::Null => Err(format!("shows {text:?} for null, not a dash")),
        Value::Number(_) if dash => Err(format!("shows a dash for {value}")),
        Value::Number(n) if n.is_i64() || n.is_u64() => match text.parse::<i128>() {
            Ok(shown) if shown == n.as_i128().unwrap() => Ok(()),
            _ => Err(format!("shows {text:?} for the integer {n}")),
        },
        Value::Number(n) => {
            let value = n.as_f64().unwrap();
            let not_a_number = || format!("shows {text:?}, not a number (the summary has {value})");
            // A typographic minus (U+2212) reads as the minus it is.
            let ascii = text.replace('\u{2212}', "-");
            let shown: f64 = ascii.parse().map_err(|_| not_a_number())?;
            let (mantissa, exponent) = match ascii.split_once(['e', 'E']) {
                Some((m, e)) => (m, e.parse::<i32>().map_err(|_| not_a_number())?),
                None => (ascii.as_str(), 0),
            };
            let decimals = mantissa.split_once('.').map_or(0, |(_, f)| f.len()) as i32;
            let tolerance = 0.5 * 10f64.powi(exponent - decimals) * 1.0001;
            if (shown - value).abs() <= tolerance {
                Ok(())
            } else {
                let off = (shown - value).abs();
                Err(format!(
                    "shows {text:?}, the summary has {value} (off by {off:.3e}, more than \
                     {tolerance:.3e})"
                ))
            }
        }
        _ => Err(format!("points at {value}, not a number or null")),
    }
}

/// A screenshot's share of pixels unlike its most common colour, its count of colours, its size.
fn screenshot_ink(png_base64: &str) -> (f64, usize, (u32, u32)) {
    let png = base64::engine::general_purpose::STANDARD
        .decode(png_base64)
        .expect("the screenshot is not base64");
    let image = ::image::load_from_memory_with_format(&png, ::image::ImageFormat::Png)
        .expect("the screenshot is not a PNG")
        .to_rgb8();
    let mut counts: HashMap<[u8; 3], usize> = HashMap::new();
    for pixel in image.pixels() {
        *counts.entry(pixel.0).or_default() += 1;
    }
    let total = (image.width() * image.height()) as usize;
    let most = counts.values().copied().max().unwrap_or(0);
    let ink = (total - most) as f64 / total.max(1) as f64;
    (ink, counts.len(), image.dimensions())
}

#[test]
#[ignore = "needs chromium and chromedriver: .ci/run installs them and runs the ignored browser tests"]
fn report_renders_self_contained_and_matches_its_summary() {
    let (html_path, summary_path) = report_paths();
    let html = std::fs::read_to_string(&html_path).unwrap();
    let summary: Value = crate::util::read_json(&summary_path);
    // Every problem is collected, so that one run names them all.
    let mut errors = Vec::new();
    if !html.contains("@media print") {
        errors.push("the report has no `@media print` stylesheet".to_string());
    }

    let driver = Driver::start();
    driver.set_window(1280, 900);
    // Drop what the browser logged before the report (its blank start page).
    driver.log_entries("browser");
    driver.log_entries("performance");
    driver.session("POST", "/url", Some(&json!({"url": file_url(&html_path)})));
    // The URL as the browser spells it, which the document requests below must all be.
    let page_url = driver.session("GET", "/url", None);
    let page_url = page_url.as_str().unwrap().to_string();

    let layout: Layout = driver.execute(LAYOUT_SCRIPT, json!([SECTIONS]));
    let drawn = |[w, h]: [f64; 2]| w > 0.0 && h > 0.0;
    for (id, section) in SECTIONS.iter().zip(&layout.sections) {
        match section {
            None => errors.push(format!("no <section id=\"{id}\">")),
            Some(s) if !drawn(s.size) => {
                errors.push(format!("section {id} is drawn at {:?} px", s.size))
            }
            Some(s) if s.figures == 0 && SECTIONS_WITH_FIGURES.contains(id) => {
                errors.push(format!("section {id} has no <figure>"))
            }
            Some(_) => {}
        }
    }
    for (i, figure) in layout.figures.iter().enumerate() {
        let place = format!("figure {i} (in section {:?})", figure.section);
        match figure.svg {
            None => errors.push(format!("{place} holds no inline <svg>")),
            Some(svg) if !drawn(svg) => {
                errors.push(format!("{place}'s svg is drawn at {svg:?} px"))
            }
            Some(_) if !drawn(figure.size) => {
                errors.push(format!("{place} is drawn at {:?} px", figure.size))
            }
            Some(_) => {}
        }
    }
    for (i, table) in layout.tables.iter().enumerate() {
        if table.head_cells == 0 {
            errors.push(format!(
                "table {i} (in section {:?}) has no <thead> with <th>",
                table.section
            ));
        }
    }
    for cell in &layout.cells {
        let place = format!("cell data-key={:?}", cell.key);
        if cell.tag != "TD" {
            errors.push(format!(
                "{place} is a <{}>, not a <td>",
                cell.tag.to_lowercase()
            ));
        }
        match summary.pointer(&cell.key) {
            None => errors.push(format!(
                "{place}: no such pointer in {}",
                summary_path.display()
            )),
            Some(value) => {
                if let Err(e) = check_cell(&cell.text, value) {
                    errors.push(format!("{place} {e}"));
                }
            }
        }
    }
    if !layout
        .cells
        .iter()
        .any(|c| c.section.as_deref() == Some("merges"))
    {
        errors.push("the merges section has no data-key cell".to_string());
    }
    // A number the summary does not back is a number no test checks.
    for text in &layout.bare_cells {
        if text.trim().parse::<f64>().is_ok() {
            errors.push(format!(
                "a <td> shows the number {text:?} without a data-key"
            ));
        }
    }

    let shot = driver.session("GET", "/screenshot", None);
    let (ink, colours, size) = screenshot_ink(shot.as_str().expect("a base64 screenshot"));
    if ink <= MIN_INK || colours < MIN_COLOURS {
        errors.push(format!(
            "the {}x{} screenshot looks blank: {:.2}% of pixels differ from the most common \
             colour (need more than {:.0}%), {colours} colours (need {MIN_COLOURS})",
            size.0,
            size.1,
            ink * 100.0,
            MIN_INK * 100.0
        ));
    }

    let resources: Vec<String> = driver.execute(
        "return performance.getEntriesByType('resource').map(e => e.name);",
        json!([]),
    );
    for url in resources {
        if !(url.starts_with("file:") || url.starts_with("data:")) {
            errors.push(format!("the page loaded the resource {url}"));
        }
    }

    driver.set_window(800, 900);
    let overflow: Overflow = driver.execute(OVERFLOW_SCRIPT, json!([]));
    if overflow.inner_width > 800.0 {
        errors.push(format!(
            "the window did not shrink to 800 px (innerWidth {})",
            overflow.inner_width
        ));
    }
    for (name, [scroll, client]) in [("document", overflow.document), ("body", overflow.body)] {
        if scroll > client + 1.0 {
            errors.push(format!(
                "at 800 px the {name} scrolls sideways: scrollWidth {scroll} > clientWidth \
                 {client}; too wide: {}",
                overflow.wide.join(", ")
            ));
        }
    }

    // Read last, so that they hold everything the page did above.
    for entry in driver.log_entries("browser") {
        if entry.level == "SEVERE" || entry.level == "WARNING" {
            errors.push(format!("console {}: {}", entry.level, entry.message));
        }
    }
    for entry in driver.log_entries("performance") {
        let event: Value = serde_json::from_str(&entry.message).unwrap();
        let event = &event["message"];
        if event["method"] != "Network.requestWillBeSent" {
            continue;
        }
        let url = event["params"]["request"]["url"].as_str().unwrap_or("");
        if !(url.starts_with("file:") || url.starts_with("data:")) {
            errors.push(format!("the page requested {url}"));
        } else if event["params"]["type"] == "Document" && url != page_url {
            errors.push(format!("the page opened the document {url}"));
        }
    }

    assert!(
        errors.is_empty(),
        "{} fails {} check(s):\n  {}",
        html_path.display(),
        errors.len(),
        errors.join("\n  ")
    );
}
