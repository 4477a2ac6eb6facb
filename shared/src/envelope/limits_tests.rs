//! Every envelope limit at and past its bound, with [`check_shape`]'s exact refusal texts and
//! 0.5.x's check order (`wire.md` §2.3), and the refusals of [`build`].

use serde_json::{json, Value};

use super::*;
use crate::limits::{MAX_BODY, MAX_SEALED_BODY};

const ID: &str = "01KDVDNB3392QN2PG1JAZXH9CM";

/// A valid plain envelope (unsigned: the shape check does not look at `sig`).
fn base() -> Value {
    json!({
        "v": 3, "id": ID, "ts": "2026-01-01T00:00:01.123Z", "from": "alice@laptop", "to": ["bob@desktop"],
        "thread": ID, "reply_to": null, "kind": "message", "subject": "Hello", "body": "Hi @bob",
        "needs_reply": false, "refs": [], "meta": {"mentions": ["bob"], "directives": [], "tags": [], "task_refs": []},
        "authority": null, "enc": null,
    })
}

/// A structurally valid `enc` whose ciphertext is `body`.
fn enc_with(body: &str) -> Value {
    json!({
        "v": 1, "alg": crate::seal::ENC_ALG, "epk": crate::b64::encode(&[1u8; 32]),
        "nonce": crate::b64::encode(&[2u8; 24]), "body": body,
    })
}

/// A valid sealed envelope: `body` and `enc.body` are the same ciphertext text.
fn sealed(ciphertext: &str) -> Value {
    let mut e = base();
    e["body"] = json!(ciphertext);
    e["enc"] = enc_with(ciphertext);
    e
}

fn shape_of(mut e: Value, change: impl FnOnce(&mut Value)) -> Result<(), String> {
    change(&mut e);
    check_shape(&e)
}

#[track_caller]
fn ok(change: impl FnOnce(&mut Value)) {
    assert_eq!(shape_of(base(), change), Ok(()));
}

#[track_caller]
fn refused(reason: &str, change: impl FnOnce(&mut Value)) {
    assert_eq!(shape_of(base(), change), Err(reason.to_string()));
}

fn remove(e: &mut Value, key: &str) {
    e.as_object_mut().map(|m| m.remove(key));
}

/// `n` distinct strings of exactly `len` ASCII characters.
fn strings(n: usize, len: usize) -> Vec<String> {
    (0..n).map(|i| format!("{i:0len$}")).collect()
}

#[test]
fn the_base_envelopes_are_valid() {
    assert_eq!(check_shape(&base()), Ok(()));
    assert_eq!(check_shape(&sealed("AAAA")), Ok(()));
}

#[test]
fn plain_body_counts_utf8_bytes() {
    ok(|e| e["body"] = json!("a".repeat(262_144)));
    refused("body over 262144 bytes", |e| {
        e["body"] = json!("a".repeat(262_145))
    });
    assert_eq!(MAX_BODY, 262_144);
    // Bytes, not characters: 131,072 × "é" is exactly 262,144 bytes.
    ok(|e| e["body"] = json!("é".repeat(131_072)));
    refused("body over 262144 bytes", |e| {
        e["body"] = json!(format!("{}a", "é".repeat(131_072)))
    });
    refused("bad body", |e| e["body"] = json!(null));
    refused("bad body", |e| remove(e, "body"));
}

#[test]
fn sealed_body_cap_is_max_sealed_body() {
    assert_eq!(MAX_SEALED_BODY, 349_548);
    let at = "A".repeat(349_548);
    let over = "A".repeat(349_549);
    assert_eq!(check_shape(&sealed(&at)), Ok(()));
    assert_eq!(
        check_shape(&sealed(&over)),
        Err("body over 349548 bytes".into())
    );
    // A sealed envelope may carry a body larger than the plain cap.
    assert_eq!(check_shape(&sealed(&"A".repeat(262_145))), Ok(()));
    // `enc.body` has its own check, after the enc shape.
    let mut e = sealed("AAAA");
    e["enc"]["body"] = json!(over);
    assert_eq!(check_shape(&e), Err("sealed body over 349548 bytes".into()));
    e["enc"]["body"] = json!(at);
    assert_eq!(check_shape(&e), Ok(()));
}

#[test]
fn subject_counts_utf16_units_and_refuses_controls() {
    ok(|e| e["subject"] = json!("s".repeat(200)));
    refused("subject over 200 characters", |e| {
        e["subject"] = json!("s".repeat(201))
    });
    // An astral character is two UTF-16 units: 100 are the cap, 101 are over it.
    ok(|e| e["subject"] = json!("\u{1f600}".repeat(100)));
    refused("subject over 200 characters", |e| {
        e["subject"] = json!("\u{1f600}".repeat(101))
    });
    refused("subject over 200 characters", |e| {
        e["subject"] = json!(format!("a{}", "\u{1f600}".repeat(100)))
    });
    // Units, not bytes: 200 × "é" is 400 bytes and fine.
    ok(|e| e["subject"] = json!("é".repeat(200)));
    for c in [
        '\n', '\r', '\t', '\0', '\u{1f}', '\u{7f}', '\u{85}', '\u{2028}', '\u{2029}',
    ] {
        refused("subject contains control characters", |e| {
            e["subject"] = json!(format!("a{c}b"))
        });
    }
    // Neighbours of the control set are fine.
    for c in ['\u{80}', '\u{86}', '\u{a0}', '\u{2027}', '\u{202a}'] {
        ok(|e| e["subject"] = json!(format!("a{c}b")));
    }
    ok(|e| e["subject"] = json!(""));
    refused("bad subject", |e| e["subject"] = json!(7));
    // The length check comes first.
    refused("subject over 200 characters", |e| {
        e["subject"] = json!(format!("\n{}", "s".repeat(200)))
    });
}

#[test]
fn from_limits() {
    ok(|e| e["from"] = json!(format!("a@{}", "b".repeat(298))));
    refused("from over 300 characters", |e| {
        e["from"] = json!(format!("a@{}", "b".repeat(299)))
    });
    ok(|e| e["from"] = json!(format!("a@{}", "é".repeat(298))));
    refused("bad from", |e| e["from"] = json!("alice"));
    refused("bad from", |e| e["from"] = json!(["alice@laptop"]));
    refused("bad from", |e| remove(e, "from"));
    // Without `@`, "bad from" wins over the length.
    refused("bad from", |e| e["from"] = json!("b".repeat(301)));
}

#[test]
fn recipient_limits() {
    ok(|e| {
        e["to"] = json!(strings(100, 5)
            .iter()
            .map(|s| format!("{s}@h"))
            .collect::<Vec<_>>())
    });
    refused("more than 100 recipients", |e| {
        e["to"] = json!(strings(101, 5))
    });
    ok(|e| e["to"] = json!([format!("a@{}", "b".repeat(298))]));
    refused("recipient over 300 characters", |e| {
        e["to"] = json!(["bob@desktop", format!("a@{}", "b".repeat(299))])
    });
    refused("bad to", |e| e["to"] = json!([]));
    refused("bad to", |e| e["to"] = json!(["bob@desktop", 1]));
    refused("bad to", |e| e["to"] = json!("bob@desktop"));
    // The count comes before each recipient's length.
    refused("more than 100 recipients", |e| {
        e["to"] = json!(strings(101, 301))
    });
}

#[test]
fn ref_limits() {
    let msg = "more than 100 refs or a ref over 2048 characters";
    ok(|e| e["refs"] = json!(strings(100, 10)));
    refused(msg, |e| e["refs"] = json!(strings(101, 10)));
    ok(|e| e["refs"] = json!(["r".repeat(2048)]));
    refused(msg, |e| e["refs"] = json!(["ok", "r".repeat(2049)]));
    ok(|e| e["refs"] = json!(["\u{1f600}".repeat(1024)]));
    refused(msg, |e| {
        e["refs"] = json!([format!("a{}", "\u{1f600}".repeat(1024))])
    });
    refused("bad refs", |e| e["refs"] = json!([1]));
    refused("bad refs", |e| remove(e, "refs"));
}

#[test]
fn thread_and_reply_to_limits() {
    ok(|e| e["thread"] = json!("t".repeat(300)));
    refused("bad thread", |e| e["thread"] = json!("t".repeat(301)));
    refused("bad thread", |e| remove(e, "thread"));
    ok(|e| e["reply_to"] = json!("r".repeat(300)));
    refused("bad reply_to", |e| e["reply_to"] = json!("r".repeat(301)));
    refused("bad reply_to", |e| remove(e, "reply_to"));
    refused("bad reply_to", |e| e["reply_to"] = json!(1));
}

#[test]
fn id_kind_version_ts_and_needs_reply() {
    refused("bad id", |e| e["id"] = json!("01KDVDNB3392QN2PG1JAZXH9CI")); // I is not Crockford
    refused("bad id", |e| e["id"] = json!("01kdvdnb3392qn2pg1jazxh9cm"));
    refused("bad id", |e| e["id"] = json!("01KDVDNB3392QN2PG1JAZXH9C"));
    refused("bad id", |e| remove(e, "id"));
    for kind in KINDS {
        ok(|e| e["kind"] = json!(kind));
    }
    refused("bad kind", |e| e["kind"] = json!("memo"));
    refused("bad kind", |e| e["kind"] = json!("Message"));
    refused("bad kind", |e| remove(e, "kind"));
    refused("unsupported version", |e| e["v"] = json!(2));
    refused("unsupported version", |e| e["v"] = json!("3"));
    ok(|e| e["v"] = json!(3.0));
    refused("bad ts", |e| e["ts"] = json!("yesterday"));
    refused("bad ts", |e| remove(e, "ts"));
    refused("bad needs_reply", |e| e["needs_reply"] = json!("yes"));
    assert_eq!(check_shape(&json!([])), Err("not an object".into()));
    assert_eq!(check_shape(&json!(null)), Err("not an object".into()));
}

#[test]
fn enc_checks() {
    refused("bad enc", |e| remove(e, "enc"));
    let sealed_with = |change: fn(&mut Value)| shape_of(sealed("AAAA"), change);
    assert_eq!(sealed_with(|e| e["enc"] = json!(5)), Err("bad enc".into()));
    assert_eq!(
        sealed_with(|e| e["enc"] = json!("x")),
        Err("bad enc".into())
    );
    assert_eq!(
        sealed_with(|e| e["enc"]["v"] = json!(2)),
        Err("unsupported enc version".into())
    );
    assert_eq!(
        sealed_with(|e| e["enc"]["alg"] = json!("aes")),
        Err("unsupported enc algorithm".into())
    );
    assert_eq!(
        sealed_with(|e| e["enc"]["epk"] = json!(crate::b64::encode(&[1u8; 31]))),
        Err("bad enc epk".into())
    );
    assert_eq!(
        sealed_with(|e| e["enc"]["nonce"] = json!(crate::b64::encode(&[1u8; 16]))),
        Err("bad enc nonce".into())
    );
    assert_eq!(
        sealed_with(|e| e["enc"]["body"] = json!("")),
        Err("bad enc body".into())
    );
    assert_eq!(
        sealed_with(|e| e["enc"]["body"] = json!(1)),
        Err("bad enc body".into())
    );
}

#[test]
fn meta_limits() {
    ok(|e| e["meta"]["hop"] = json!(0));
    ok(|e| e["meta"]["hop"] = json!(1000));
    for bad in [json!(1001), json!(-1), json!(1.5), json!("1"), json!(null)] {
        refused("bad hop", |e| e["meta"]["hop"] = bad);
    }
    ok(|e| e["meta"]["local_names"] = json!((0..100).map(|i| format!("n{i}")).collect::<Vec<_>>()));
    refused("bad local names", |e| {
        e["meta"]["local_names"] = json!((0..101).map(|i| format!("n{i}")).collect::<Vec<_>>())
    });
    refused("bad local names", |e| {
        e["meta"]["local_names"] = json!(["Bob"])
    });
    refused("bad local names", |e| {
        e["meta"]["local_names"] = json!("bob")
    });
    ok(|e| e["meta"]["project"] = json!("p".repeat(300)));
    refused("bad project", |e| {
        e["meta"]["project"] = json!("p".repeat(301))
    });
    refused("bad project", |e| e["meta"]["project"] = json!(1));
    ok(|e| e["meta"]["project_key"] = json!("k".repeat(300)));
    refused("bad project key", |e| {
        e["meta"]["project_key"] = json!("k".repeat(301))
    });
    ok(|e| e["meta"]["origin"] = json!("external"));
    ok(|e| e["meta"]["origin"] = json!("agent"));
    refused("bad origin", |e| e["meta"]["origin"] = json!("web"));
    ok(|e| e["meta"]["sender_verification"] = json!("leased"));
    refused("bad sender verification", |e| {
        e["meta"]["sender_verification"] = json!("trusted")
    });
    refused("bad meta.tags", |e| e["meta"]["tags"] = json!([1]));
    refused("bad meta.task_refs", |e| {
        remove(&mut e["meta"], "task_refs")
    });
    refused("bad meta", |e| e["meta"] = json!([]));
}

#[test]
fn authority_checks() {
    let grant = json!({
        "v": 2, "id": "g", "iss": "i", "sub": "session:x", "agent": "a", "host": "h",
        "iat": "t", "exp": "t", "nonce": "n", "sig": "s", "caps": ["decision"],
    });
    ok(|e| e["authority"] = json!({"grant": grant, "session_sig": "x"}));
    ok(|e| e["authority"] = json!({"owner_sig": "x", "owner_fp": "f"}));
    refused("bad authority", |e| e["authority"] = json!([]));
    refused("bad authority", |e| remove(e, "authority"));
    refused("bad owner authority", |e| {
        e["authority"] = json!({"owner_sig": "x"})
    });
    refused("bad owner authority", |e| {
        e["authority"] = json!({"owner_sig": "x", "owner_fp": "f", "session_sig": "y"})
    });
    refused("bad grant authority", |e| {
        e["authority"] = json!({"grant": {"v": 1}, "session_sig": "x"})
    });
    refused("bad grant authority", |e| {
        e["authority"] = json!({"grant": grant, "session_sig": "x", "owner_fp": "f"})
    });
    refused("bad grant.caps", |e| {
        e["authority"] = json!({"grant": grant, "session_sig": "x"});
        e["authority"]["grant"]["caps"] = json!([1]);
    });
    // The grant's string fields are checked in 0.5.x's order.
    let mut g = grant.clone();
    let fields = [
        "id", "iss", "sub", "agent", "host", "iat", "exp", "nonce", "sig",
    ];
    for f in fields {
        remove(&mut g, f);
    }
    for f in fields {
        let auth = json!({"grant": g, "session_sig": "x"});
        refused(&format!("bad grant.{f}"), |e| e["authority"] = auth);
        g[f] = json!("v");
    }
}

type Fault = (&'static str, fn(&mut Value));

/// Applies every fault to `base`, then removes them from the front one at a time: each time the
/// shape check must report the earliest remaining fault, and the clean envelope passes.
#[track_caller]
fn peel(base: Value, faults: &[Fault]) {
    for i in 0..faults.len() {
        let mut e = base.clone();
        for (_, f) in &faults[i..] {
            f(&mut e);
        }
        let left: Vec<&str> = faults[i..].iter().map(|(r, _)| *r).collect();
        assert_eq!(
            check_shape(&e),
            Err(faults[i].0.to_string()),
            "faults present: {left:?}"
        );
    }
    assert_eq!(check_shape(&base), Ok(()));
}

#[test]
fn several_faults_report_the_first_in_0_5_order() {
    // One fault per field, in 0.5.x checkShape order.
    peel(
        base(),
        &[
            ("unsupported version", |e| e["v"] = json!(2)),
            ("bad id", |e| e["id"] = json!("nope")),
            ("bad from", |e| e["from"] = json!("alice")),
            ("bad to", |e| e["to"] = json!([])),
            ("bad kind", |e| e["kind"] = json!("memo")),
            ("bad enc", |e| remove(e, "enc")),
            ("bad body", |e| e["body"] = json!(1)),
            ("bad subject", |e| e["subject"] = json!(null)),
            ("bad ts", |e| e["ts"] = json!("not a time")),
            ("bad thread", |e| e["thread"] = json!(1)),
            ("bad reply_to", |e| remove(e, "reply_to")),
            ("bad needs_reply", |e| e["needs_reply"] = json!("yes")),
            ("bad refs", |e| e["refs"] = json!("x")),
            ("bad authority", |e| e["authority"] = json!([])),
            ("bad meta", |e| remove(e, "meta")),
        ],
    );
    // Limit faults on a sealed envelope.
    peel(
        sealed("AAAA"),
        &[
            ("from over 300 characters", |e| {
                e["from"] = json!(format!("a@{}", "b".repeat(299)))
            }),
            ("more than 100 recipients", |e| {
                e["to"] = json!(strings(101, 4))
            }),
            ("body over 349548 bytes", |e| {
                e["body"] = json!("A".repeat(349_549))
            }),
            ("subject over 200 characters", |e| {
                e["subject"] = json!("s".repeat(201))
            }),
            ("bad reply_to", |e| e["reply_to"] = json!("r".repeat(301))),
            ("more than 100 refs or a ref over 2048 characters", |e| {
                e["refs"] = json!(["r".repeat(2049)])
            }),
            ("unsupported enc version", |e| e["enc"]["v"] = json!(2)),
            ("bad owner authority", |e| {
                e["authority"] = json!({"owner_sig": 1, "owner_fp": "f"})
            }),
            ("bad meta.tags", |e| e["meta"]["tags"] = json!([1])),
        ],
    );
    peel(
        base(),
        &[
            ("recipient over 300 characters", |e| {
                e["to"] = json!([format!("a@{}", "b".repeat(299))])
            }),
            ("body over 262144 bytes", |e| {
                e["body"] = json!("a".repeat(262_145))
            }),
            ("subject contains control characters", |e| {
                e["subject"] = json!("a\u{2028}b")
            }),
            ("bad thread", |e| e["thread"] = json!("t".repeat(301))),
            ("bad grant authority", |e| {
                e["authority"] = json!({"grant": {"v": 1}, "session_sig": "x"})
            }),
            ("bad hop", |e| e["meta"]["hop"] = json!(1001)),
        ],
    );
    // Inside `enc`, then the sealed body's own cap.
    peel(
        sealed("AAAA"),
        &[
            ("unsupported enc version", |e| e["enc"]["v"] = json!(2)),
            ("unsupported enc algorithm", |e| {
                e["enc"]["alg"] = json!("aes")
            }),
            ("bad enc epk", |e| e["enc"]["epk"] = json!("AAAA")),
            ("bad enc nonce", |e| e["enc"]["nonce"] = json!("AAAA")),
            ("bad enc body", |e| e["enc"]["body"] = json!("")),
            ("bad authority", |e| e["authority"] = json!("x")),
        ],
    );
    // Inside `meta`.
    peel(
        base(),
        &[
            ("bad meta.mentions", |e| e["meta"]["mentions"] = json!(null)),
            ("bad meta.directives", |e| {
                e["meta"]["directives"] = json!([null])
            }),
            ("bad meta.tags", |e| e["meta"]["tags"] = json!({})),
            ("bad meta.task_refs", |e| {
                e["meta"]["task_refs"] = json!("T12")
            }),
            ("bad sender verification", |e| {
                e["meta"]["sender_verification"] = json!("trusted")
            }),
            ("bad hop", |e| e["meta"]["hop"] = json!(-1)),
            ("bad origin", |e| e["meta"]["origin"] = json!("web")),
            ("bad project", |e| {
                e["meta"]["project"] = json!("p".repeat(301))
            }),
            ("bad project key", |e| {
                e["meta"]["project_key"] = json!("k".repeat(301))
            }),
            ("bad local names", |e| {
                e["meta"]["local_names"] = json!(strings(101, 3))
            }),
        ],
    );
}

fn draft() -> Draft {
    Draft {
        from: "alice@laptop".into(),
        to: vec!["bob@desktop".into()],
        subject: "Hello".into(),
        body: "Hi @Bob /claim T123 #Ops".into(),
        ..Draft::default()
    }
}

fn build_with(change: impl FnOnce(&mut Draft)) -> Result<Envelope, BuildError> {
    let mut d = draft();
    change(&mut d);
    build(&d, ID.into(), 1_767_225_601_123)
}

#[test]
fn build_refusals() {
    for blank in ["", " ", "\n\t ", "\u{feff}", "\u{2028}\u{3000}"] {
        let err = build_with(|d| d.subject = blank.into()).unwrap_err();
        assert_eq!(err, BuildError::SubjectRequired, "{blank:?}");
        assert_eq!(err.to_string(), "subject is required");
    }
    // U+0085 is not JavaScript whitespace: the subject is kept, as a space.
    assert_eq!(
        build_with(|d| d.subject = "\u{85}".into()).map(|e| e.subject),
        Ok(" ".into())
    );

    assert!(build_with(|d| d.body = "a".repeat(MAX_BODY)).is_ok());
    let err = build_with(|d| d.body = "a".repeat(MAX_BODY + 1)).unwrap_err();
    assert_eq!(err, BuildError::BodyTooLarge);
    assert_eq!(
        err.to_string(),
        "body is over 256 KB; put large content in refs"
    );

    let err = build_with(|d| d.to.clear()).unwrap_err();
    assert_eq!(err, BuildError::NoRecipient);
    assert_eq!(err.to_string(), "at least one recipient is required");

    // 0.5.x's order: subject, body, recipients; then the shape check.
    let all = build_with(|d| {
        d.subject = " ".into();
        d.body = "a".repeat(MAX_BODY + 1);
        d.to.clear();
    });
    assert_eq!(all.unwrap_err(), BuildError::SubjectRequired);
    let two = build_with(|d| {
        d.body = "a".repeat(MAX_BODY + 1);
        d.to.clear();
    });
    assert_eq!(two.unwrap_err(), BuildError::BodyTooLarge);
    assert_eq!(
        build_with(|d| d.kind = Some("memo".into())).unwrap_err(),
        BuildError::Shape("bad kind".into())
    );
    assert_eq!(
        build_with(|d| d.to = vec!["x@y".into(); 101])
            .unwrap_err()
            .to_string(),
        "more than 100 recipients"
    );
}

#[test]
fn build_defaults_and_subject_cleanup() {
    let e = build_with(|_| {}).unwrap();
    assert_eq!((e.v, e.id.as_str(), e.thread.as_str()), (3, ID, ID));
    assert_eq!(e.ts, "2026-01-01T00:00:01.123Z");
    assert_eq!(
        (
            e.kind.as_str(),
            e.reply_to.clone(),
            e.enc.clone(),
            e.sig.clone()
        ),
        ("message", None, None, None)
    );
    assert_eq!(e.meta.mentions, vec!["bob"]);
    assert_eq!(e.meta.directives, vec!["claim"]);
    assert_eq!(e.meta.tags, vec!["ops"]);
    assert_eq!(e.meta.task_refs, vec!["T123"]);
    assert_eq!(check_shape(&e.to_value()), Ok(()));

    // Control characters become spaces; the subject is cut at 200 UTF-16 units without
    // splitting a surrogate pair.
    let subject = |s: String| build_with(|d| d.subject = s).unwrap().subject;
    assert_eq!(subject("a\nb\u{2028}c\u{7f}d".into()), "a b c d");
    assert_eq!(subject("s".repeat(250)), "s".repeat(200));
    assert_eq!(subject("\u{1f600}".repeat(101)), "\u{1f600}".repeat(100));
    assert_eq!(
        subject(format!("a{}", "\u{1f600}".repeat(100))),
        format!("a{}", "\u{1f600}".repeat(99))
    );
}
