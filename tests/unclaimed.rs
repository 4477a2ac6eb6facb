//! Mail for an agent a paired host does not have (issue 17, point 3), with two real daemons
//! over the LAN on 127.0.0.1: `send` refuses `nobody@hostb` when hostb's agent directory is
//! known and lists no `nobody` (exit 3, naming hostb's agents); `send --force` sends it, and
//! hostb holds it as unclaimed (listed by `inbox --unclaimed`, no delivered receipt to the
//! sender, whose `sent` does not say delivered); `whoami --as nobody` on hostb makes it
//! nobody's mail and the delivered receipt reaches the sender.

use crate::helper::mesh::Host;
use crate::helper::wait_for;
use serde_json::Value;

/// The newest receipt state `host` holds for (`id`, `recipient`).
fn receipt_state(host: &Host, id: &str, recipient: &str) -> Option<String> {
    host.db()
        .query_row(
            "SELECT state FROM remote_receipts WHERE msg_id = ?1 AND recipient = ?2",
            [id, recipient],
            |r| r.get(0),
        )
        .ok()
}

/// `agentmbx sent --as <agent> --json`: the recipients of message `id`.
fn sent_recipients(host: &Host, agent: &str, id: &str) -> Vec<Value> {
    let out = host.home.run(&["sent", "--as", agent, "--json"]);
    out.assert_success();
    let page = out.json();
    page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .find(|m| m["id"] == id)
        .unwrap_or_else(|| panic!("{id} in sent: {page}"))["recipients"]
        .as_array()
        .expect("recipients")
        .clone()
}

#[test]
fn mail_for_an_agent_hostb_does_not_have_is_refused_or_held_until_it_registers() {
    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    a.start(None);
    b.start(None);
    a.pair_with(&b);
    b.home.run(&["whoami", "--as", "bob"]).assert_success();
    // The daemon fetches its peers' directories when it starts (then every 5 minutes).
    a.restart(None);
    wait_for("hosta to know hostb's agent directory", || {
        (a.count(
            "SELECT COUNT(*) FROM peers WHERE host = ?1 AND directory_at IS NOT NULL",
            "hostb",
        ) == 1)
            .then_some(())
    });

    // Refused: exit 3, naming the agents hostb has; nothing sent.
    let send = |extra: &[&str]| {
        let mut args = vec![
            "send",
            "--as",
            "alice",
            "--to",
            "nobody@hostb",
            "--subject",
            "early",
            "-m",
            "for whoever registers as nobody",
        ];
        args.extend_from_slice(extra);
        a.home.run(&args)
    };
    let out = send(&[]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(
        out.stderr
            .contains("hostb has no agent nobody; its agents: bob.")
            && out.stderr.contains("--force"),
        "{out:#?}"
    );
    assert_eq!(a.message_count(), 0);

    // Forced: sent, with a warning; hostb holds it.
    let out = send(&["--force", "--json"]);
    out.assert_success();
    let answer = out.json();
    let id = answer["id"].as_str().expect("id").to_string();
    assert!(
        answer["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("sent anyway")),
        "{answer}"
    );
    wait_for("hostb to store the forced message", || {
        (b.messages_with_id(&id) == 1).then_some(())
    });
    let out = b.home.run(&["inbox", "--unclaimed", "--json"]);
    out.assert_success();
    let held = out.json();
    assert_eq!(held["total"], 1, "{held}");
    assert_eq!(held["messages"][0]["id"], id.as_str(), "{held}");
    assert_eq!(held["messages"][0]["name"], "nobody", "{held}");
    let out = b.home.run(&["inbox", "--unclaimed"]);
    out.assert_success();
    assert!(
        out.stdout.contains(&format!("{id}  for nobody")),
        "{out:#?}"
    );
    assert_eq!(b.deliveries_of(&id), 0);
    assert_eq!(
        b.count("SELECT COUNT(*) FROM receipt_outbox WHERE msg_id = ?1", &id),
        0,
        "no receipt for held mail"
    );
    // The sender: hostb took it over the LAN, but nobody's delivered receipt never came.
    wait_for("hosta's outbox row to settle", || {
        a.outbox(&id).filter(|r| r.state == "delivered").map(|_| ())
    });
    let recipients = sent_recipients(&a, "alice", &id);
    assert_eq!(recipients.len(), 1, "{recipients:?}");
    assert_eq!(recipients[0]["recipient"], "nobody@hostb");
    assert_eq!(recipients[0]["state"], "accepted", "{recipients:?}");
    assert_eq!(receipt_state(&a, &id, "nobody@hostb"), None);
    // doctor on hostb names the waiting mail.
    let out = b.home.run(&["doctor", "--json", "unclaimed"]);
    let report = out.json();
    assert!(
        report
            .to_string()
            .contains("held for name(s) with no agent here: nobody (1)"),
        "{report}"
    );

    // nobody registers on hostb: the mail is its, and the delivered receipt reaches hosta.
    let out = b.home.run(&["whoami", "--as", "nobody"]);
    out.assert_success();
    assert!(
        out.stderr
            .contains("1 message(s) this host held for nobody are now in its inbox; their delivered receipts go out now"),
        "{out:#?}"
    );
    assert_eq!(b.inbox_ids("nobody"), vec![id.clone()]);
    let out = b.home.run(&["inbox", "--unclaimed", "--json"]);
    assert_eq!(out.json()["total"], 0);
    let state = wait_for("nobody's delivered receipt on hosta", || {
        receipt_state(&a, &id, "nobody@hostb")
    });
    assert_eq!(state, "delivered");
    let recipients = sent_recipients(&a, "alice", &id);
    assert_eq!(recipients[0]["state"], "delivered", "{recipients:?}");
    assert_eq!(b.deliveries_of(&id), 1);
}
