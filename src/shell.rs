//! Command lines that messages and model cards suggest, quoted for a POSIX shell, so that a
//! pasted suggestion runs that command and nothing else, whatever the user gave (`$(id)`, `;`,
//! spaces, quotes).

/// `word` as one POSIX shell word: as it is when every character is one no shell treats
/// specially (ASCII letters and digits, `-_./:@,=+%`), else single-quoted, each `'` written as
/// `'\''` (POSIX.1-2017, Shell Command Language 2.2.3: nothing inside single quotes is special).
pub fn quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:@,=+%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_when_needed() {
        assert_eq!(quote("Org/Name@abc"), "Org/Name@abc");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), "'it'\\''s'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("$(id)"), "'$(id)'");
        assert_eq!(quote("a`b`;c"), "'a`b`;c'");
    }
}
