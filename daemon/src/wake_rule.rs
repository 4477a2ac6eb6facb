//! Which mail is wake-worthy for an agent: kind `request`, `task`, `decision` or `alert`, or
//! `needs_reply`, or an @mention of the agent (`@agent` or `@agent@host` in subject or body);
//! `status` never wakes. The wake brake ([`crate::mailbox::brake`]) and the hooks' filter
//! ([`crate::config::hooks`]) both apply it.
//!
//! # What it must never do
//! Read the store or depend on another module of this crate: it is a pure rule on a message's
//! fields, below every module that applies it.

/// Kinds that wake by themselves.
const WAKING_KINDS: [&str; 4] = ["request", "task", "decision", "alert"];

/// True when a message wakes `agent` of host `host` (see the module docs). `kind` `status`
/// never wakes.
pub fn is_wake_worthy(
    agent: &str,
    host: &str,
    kind: &str,
    needs_reply: bool,
    subject: &str,
    body: &str,
) -> bool {
    if kind == "status" {
        return false;
    }
    WAKING_KINDS.contains(&kind)
        || needs_reply
        || mentions(subject, agent, host)
        || mentions(body, agent, host)
}

/// True when `text` holds `@agent` or `@agent@host` as a word (not `@agentx`, not `x@agent`,
/// not `@agent@otherhost`).
fn mentions(text: &str, agent: &str, host: &str) -> bool {
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    // A word ends at the end, or at a character that is no name character and no dot that
    // goes on with a name character.
    let ends_word = |rest: &str| {
        let mut cs = rest.chars();
        match cs.next() {
            None => true,
            Some('.') => !cs.next().is_some_and(name_char),
            Some(c) => !name_char(c) && c != '@',
        }
    };
    let needle = format!("@{agent}");
    let mut from = 0;
    while let Some(pos) = text[from..].find(&needle) {
        let start = from + pos;
        let end = start + needle.len();
        from = end;
        let before_ok = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !name_char(c) && c != '@' && c != '.');
        if !before_ok {
            continue;
        }
        let rest = &text[end..];
        if ends_word(rest) {
            return true;
        }
        if let Some(h) = rest.strip_prefix('@').and_then(|h| h.strip_prefix(host)) {
            if ends_word(h) {
                return true;
            }
        }
    }
    false
}
