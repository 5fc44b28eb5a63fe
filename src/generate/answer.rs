//! Answers to questions about an image: how a multiple-choice question is put to the model and
//! how its answer is read from the generated text (`docs/reference/answers.md`). The prompt is
//! lmms-eval's V* Bench prompt; the reading follows its letter patterns, with the false match of
//! an answer that merely begins with a letter ("Answer: B" read as A) removed.

use std::sync::LazyLock;

use regex::Regex;

use crate::bail;
use crate::error::Result;

/// At most this many options: one letter each, A to Z.
pub const MAX_OPTIONS: usize = 26;

/// What follows the options in the prompt (lmms-eval's `post_prompt` for V* Bench).
pub const OPTIONS_INSTRUCTION: &str =
    "Answer with the option's letter from the given choices directly.";

/// The letter of option `i` (0-based).
fn letter(i: usize) -> char {
    (b'A' + i as u8) as char
}

/// A question's options, checked: 2 to [`MAX_OPTIONS`] distinct non-empty texts; `what` names
/// the question in errors.
pub fn check_options(options: &[String], what: &str) -> Result<()> {
    if options.len() < 2 || options.len() > MAX_OPTIONS {
        bail!(
            "{what}: {} options; a multiple-choice question has 2 to {MAX_OPTIONS}",
            options.len()
        );
    }
    for (i, o) in options.iter().enumerate() {
        if o.trim().is_empty() {
            bail!("{what}: option {} is empty", letter(i));
        }
        if options[..i].iter().any(|p| p.trim() == o.trim()) {
            bail!("{what}: option {} repeats {:?}", letter(i), o.trim());
        }
    }
    Ok(())
}

/// The user message for `question` with `options` below it, one `A. text` line each, then
/// [`OPTIONS_INSTRUCTION`]; `question` alone without options.
pub fn question_text(question: &str, options: &[String]) -> String {
    if options.is_empty() {
        return question.to_string();
    }
    let lines: Vec<String> = (options.iter().enumerate())
        .map(|(i, o)| format!("{}. {}", letter(i), o.trim()))
        .collect();
    format!(
        "{}\n{}\n{OPTIONS_INSTRUCTION}",
        question.trim(),
        lines.join("\n")
    )
}

/// The expected answer, normalised: for a multiple-choice question the option's letter (the
/// manifest's `answer` is an option's text, or its letter), otherwise [`normalize`]d text.
pub fn expected(answer: &str, options: &[String], what: &str) -> Result<String> {
    if options.is_empty() {
        return Ok(normalize(answer));
    }
    if let Some(i) = options.iter().position(|o| o.trim() == answer.trim()) {
        return Ok(letter(i).to_string());
    }
    let a = answer.trim();
    if a.len() == 1 && (0..options.len()).any(|i| a == letter(i).to_string()) {
        return Ok(a.to_string());
    }
    bail!(
        "{what}: the answer {answer:?} is not among its options ({})",
        options.join(", ")
    )
}

/// The part of `text` that answers: after the last `</think>` where the model thought aloud.
pub fn final_part(text: &str) -> &str {
    text.rsplit_once("</think>")
        .map_or(text, |(_, after)| after)
}

/// Lower case, punctuation dropped, runs of white space made one space, trimmed.
pub fn normalize(text: &str) -> String {
    let kept: String = text
        .chars()
        .map(|c| {
            if c.is_alphanumeric() {
                c.to_lowercase().next().unwrap_or(c)
            } else {
                ' '
            }
        })
        .collect();
    kept.split_whitespace().collect::<Vec<_>>().join(" ")
}

static LEADING: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^\(?([A-Z])(?:[.):\]\s]|$)").expect("a valid pattern"));
static STATED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(?i:answer|choice|option)(?:\s+is)?\s*[:\s]\s*\(?([A-Z])\b")
        .expect("a valid pattern")
});
static BRACKETED: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\(([A-Za-z])\)").expect("a valid pattern"));

/// The answer read from generated `text` ([`final_part`] of it), normalised as [`expected`]
/// gives it; `None` when nothing is read. With options the first rule that gives a letter of an
/// option wins: the text begins with the capital letter (alone, or followed by `.`, `)`, `]`,
/// `:` or a space, an opening bracket allowed); "answer/choice/option (is) X" with X capital;
/// "(x)" anywhere, either case; the text of exactly one option appears in it (compared
/// [`normalize`]d). Capitals only outside brackets, so that "the answer is a cup" names no
/// letter. Without options, the normalised text.
pub fn read(text: &str, options: &[String]) -> Option<String> {
    let text = final_part(text).trim();
    if options.is_empty() {
        return Some(normalize(text)).filter(|t| !t.is_empty());
    }
    let valid = |c: &str| {
        let c = c.to_ascii_uppercase();
        (0..options.len())
            .any(|i| c == letter(i).to_string())
            .then_some(c)
    };
    for pattern in [&*LEADING, &*STATED, &*BRACKETED] {
        if let Some(c) = pattern
            .captures_iter(text)
            .find_map(|m| valid(m.get(1)?.as_str()))
        {
            return Some(c);
        }
    }
    let said = format!(" {} ", normalize(text));
    let named: Vec<usize> = (0..options.len())
        .filter(|&i| said.contains(&format!(" {} ", normalize(&options[i]))))
        .collect();
    match named[..] {
        [i] => Some(letter(i).to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(o: &[&str]) -> Vec<String> {
        o.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_prompt_lists_lettered_options_then_the_instruction() {
        let o = opts(&["red", "blue"]);
        assert_eq!(
            question_text("What colour is the cup? ", &o),
            "What colour is the cup?\nA. red\nB. blue\nAnswer with the option's letter from the \
             given choices directly."
        );
        assert_eq!(question_text("Why?", &[]), "Why?");
    }

    #[test]
    fn letters_are_read_by_the_first_rule_that_names_an_option() {
        let o = opts(&["red", "blue", "green", "white"]);
        for (text, want) in [
            ("B", Some("B")),
            ("B.", Some("B")),
            ("(C) green", Some("C")),
            ("D) white", Some("D")),
            ("Answer: B", Some("B")),
            ("The answer is (c).", Some("C")),
            ("I think the option is D because", Some("D")),
            ("It is (B), clearly.", Some("B")),
            ("<think>maybe (A)</think>\nC", Some("C")),
            ("The cup is blue.", Some("B")),
            ("Blue or green.", None),
            ("E", None),
            ("A cup.", Some("A")),
            ("Apparently none.", None),
            ("The answer is a white cup", Some("D")),
            ("the answer is b", None),
            ("", None),
        ] {
            assert_eq!(read(text, &o).as_deref(), want, "{text:?}");
        }
    }

    #[test]
    fn the_expected_answer_is_an_option_or_its_letter() {
        let o = opts(&["red", "blue"]);
        assert_eq!(expected("blue", &o, "q").unwrap(), "B");
        assert_eq!(expected("A", &o, "q").unwrap(), "A");
        let err = expected("green", &o, "line 3").unwrap_err().to_string();
        assert!(
            err.contains("line 3") && err.contains("not among its options"),
            "{err}"
        );
        assert!(expected("C", &o, "q").is_err());
        assert_eq!(expected(" The Cat! ", &[], "q").unwrap(), "the cat");
        assert_eq!(read("the  CAT.", &[]).as_deref(), Some("the cat"));
    }

    #[test]
    fn options_are_checked() {
        assert!(check_options(&opts(&["a"]), "q").is_err());
        assert!(check_options(&opts(&["a", " a "]), "q").is_err());
        assert!(check_options(&opts(&["a", ""]), "q").is_err());
        assert!(check_options(&opts(&["a", "b"]), "q").is_ok());
    }
}
