//! Tests of `cli/mail.rs`: argument parsing of the mail commands and their helpers.

use clap::Parser;

use super::super::{Cli, Command};

#[test]
fn minted_keys_are_hex_so_a_printed_rerun_never_reads_one_as_a_flag() {
    for _ in 0..64 {
        let key = super::mint_key();
        assert_eq!(key.len(), 32);
        assert!(key.bytes().all(|b| b.is_ascii_hexdigit()), "{key}");
        assert_eq!(super::parse_key(&key), Ok(key.clone()));
    }
}

fn to_of(args: &[&str]) -> Result<Vec<String>, clap::Error> {
    let mut full = vec!["agentmbx", "send", "--as", "alice", "--subject", "s"];
    full.extend_from_slice(args);
    match Cli::try_parse_from(full)?.command {
        Command::Send(a) => Ok(a.to),
        other => panic!("{other:?}"),
    }
}

/// `--to "alice, bob@hostb"` means two addresses without their spaces; an empty one is a
/// usage error (exit 2), not a recipient `""` refused later.
#[test]
fn to_addresses_are_trimmed_and_an_empty_one_is_a_usage_error() {
    assert_eq!(
        to_of(&["--to", "alice, bob@hostb ,role:dev"]).unwrap(),
        vec!["alice", "bob@hostb", "role:dev"]
    );
    let err = to_of(&["--to", "alice,,bob"]).unwrap_err();
    assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
    assert!(err.to_string().contains("empty address"), "{err}");
}
