//! Transport selection that remembers (spec §10; issue 22 part 2), with real processes: a relay
//! and two daemons (`hosta` sends, `hostb` receives), A pinning a LAN address for B that does
//! not answer. The decision "B's LAN address does not answer" is made once per peer: the rows
//! queued for B and every new one go to the relay at once, without a LAN attempt each; a LAN
//! answer that comes after the relay push started stores nothing twice; when the address
//! answers again (a probe), new rows go over the LAN.
//!
//! LAN attempts are counted from A's log: every failed or abandoned LAN attempt to deliver (or
//! to fetch the enc key for sealing) logs one warning line ([`LAN_ATTEMPT_LINES`]).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::helper::mesh::{Host, Mesh};
use crate::helper::wait_for;

/// The warning lines of a failed or abandoned LAN attempt in the daemon's log.
const LAN_ATTEMPT_LINES: [&str; 3] = [
    "LAN delivery failed",
    "LAN delivery hangs",
    "cannot seal for the peer yet",
];
/// The log line of a peer marked LAN down.
const MARKED: &str = "does not answer: its mail goes via the relay";
/// The log line of a marked address that answers again.
const BACK: &str = "answers again: its mail goes over the LAN";

fn lan_attempts(host: &Host) -> usize {
    host.log()
        .lines()
        .filter(|l| LAN_ATTEMPT_LINES.iter().any(|n| l.contains(n)))
        .count()
}

fn log_lines(host: &Host, needle: &str) -> usize {
    host.log().lines().filter(|l| l.contains(needle)).count()
}

/// A mesh whose A pins `lan` as B's LAN address, both daemons running with their enc-key ads
/// published.
fn mesh_with_b_at(lan: SocketAddr) -> Mesh {
    let mut mesh = Mesh::configured(None);
    let db = rusqlite::Connection::open(mesh.a.home.file("mailbox.db")).expect("open A's store");
    let n = db
        .execute(
            "UPDATE peers SET addr = ?1, addr_source = 'cli' WHERE host = 'hostb'",
            [lan.to_string()],
        )
        .expect("pin B's address");
    assert_eq!(n, 1);
    drop(db);
    mesh.b.start(None);
    mesh.a.start(None);
    for host in [&mut mesh.a, &mut mesh.b] {
        host.daemon().wait_for_stderr("published the enc-key ad");
    }
    mesh
}

fn send_to_bob(mesh: &Mesh, subject: &str) -> String {
    let sent = mesh.a.send("alice", "bob@hostb", subject, "body");
    sent["id"].as_str().expect("id").to_string()
}

/// Waits until B stores every one of `ids`, then checks each is stored exactly once.
fn wait_stored_once(mesh: &Mesh, ids: &[String]) {
    for id in ids {
        wait_for(&format!("{id} stored at B"), || {
            (mesh.b.messages_with_id(id) > 0).then_some(())
        });
    }
    for id in ids {
        assert_eq!(mesh.b.messages_with_id(id), 1, "stored copies of {id}");
    }
}

/// `(state, via)` of A's outbox row `id`.
fn row_route(host: &Host, id: &str) -> (String, Option<String>) {
    host.db()
        .query_row(
            "SELECT state, via FROM outbox WHERE msg_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("outbox row")
}

/// Every row of `ids` ends `delivered` via the relay (B's receipt settles it).
fn wait_delivered_via(host: &Host, ids: &[String], via: &str) {
    for id in ids {
        wait_for(&format!("{id} delivered via {via}"), || {
            let (state, v) = row_route(host, id);
            (state == "delivered").then_some(v)
        });
        assert_eq!(row_route(host, id).1.as_deref(), Some(via), "route of {id}");
    }
}

/// What the stand-in for B's LAN address does with a connection.
#[derive(Debug, Clone)]
enum Mode {
    /// Accepts and never answers (the connection is held open until A closes it).
    Hang,
    /// Forwards to B's real LAN server.
    Pass(SocketAddr),
    /// Forwards, holding each `POST /v2/envelopes` back this long first.
    DelayEnvelopes(SocketAddr, Duration),
}

/// A listener standing in for B's LAN address, in a [`Mode`] that can change while it runs
/// (read per chunk, so a pooled connection follows it too). Kept open for the whole test.
struct StandIn {
    addr: SocketAddr,
    mode: Arc<Mutex<Mode>>,
}

impl StandIn {
    fn start(mode: Mode) -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the stand-in");
        let addr = listener.local_addr().expect("stand-in address");
        let mode = Arc::new(Mutex::new(mode));
        let m = mode.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let m = m.clone();
                std::thread::spawn(move || serve(conn, m));
            }
        });
        StandIn { addr, mode }
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock().expect("mode lock") = mode;
    }
}

fn serve(mut client: TcpStream, mode: Arc<Mutex<Mode>>) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut upstream: Option<TcpStream> = None;
    loop {
        let n = match client.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let now = mode.lock().expect("mode lock").clone();
        let target = match now {
            // Never answers: the bytes are read and dropped, the connection stays open (a
            // pooled connection that forwarded before included).
            Mode::Hang => continue,
            Mode::Pass(t) => Some(t),
            Mode::DelayEnvelopes(t, d) => {
                if buf[..n].starts_with(b"POST /v2/envelopes") {
                    std::thread::sleep(d);
                }
                Some(t)
            }
        };
        if upstream.is_none() {
            let Some(t) = target else { return };
            let Ok(up) = TcpStream::connect(t) else {
                return;
            };
            let (Ok(mut from), Ok(mut to)) = (up.try_clone(), client.try_clone()) else {
                return;
            };
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut from, &mut to);
                let _ = to.shutdown(std::net::Shutdown::Both);
            });
            upstream = Some(up);
        }
        scrub_port_hint(&mut buf[..n]);
        if let Some(up) = upstream.as_mut() {
            if up.write_all(&buf[..n]).is_err() {
                return;
            }
        }
    }
}

/// Zeroes the digits of A's `x-mbx-port` hint (unsigned, advisory) in a forwarded chunk, so B
/// does not learn A's real LAN address through the stand-in and A is not re-pointed past it.
fn scrub_port_hint(chunk: &mut [u8]) {
    let name = b"x-mbx-port: ";
    let mut i = 0;
    while i + name.len() <= chunk.len() {
        if chunk[i..].len() >= name.len() && chunk[i..i + name.len()].eq_ignore_ascii_case(name) {
            let mut j = i + name.len();
            while j < chunk.len() && chunk[j].is_ascii_digit() {
                chunk[j] = b'0';
                j += 1;
            }
            i = j;
        } else {
            i += 1;
        }
    }
}

/// A refusing LAN address: bound without listen(), held for the whole test, so every connect
/// is refused and the port stays reserved.
fn refusing_address() -> (socket2::Socket, SocketAddr) {
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    let any: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    s.bind(&any.into()).expect("bind");
    let addr = s
        .local_addr()
        .expect("local addr")
        .as_socket()
        .expect("an inet address");
    (s, addr)
}

/// B's LAN address refuses connections: the first message pays the one detection, the
/// queued rows and every later one go straight to the relay, all arrive once.
#[test]
fn a_refusing_lan_address_sends_every_row_to_the_relay_after_one_attempt() {
    let (_dead, addr) = refusing_address();
    let mesh = mesh_with_b_at(addr);
    let started = Instant::now();
    let first: Vec<String> = (0..12)
        .map(|i| send_to_bob(&mesh, &format!("queued {i}")))
        .collect();
    wait_stored_once(&mesh, &first);
    eprintln!(
        "refused: 12 queued rows stored at B after {:?}",
        started.elapsed()
    );
    assert_eq!(log_lines(&mesh.a, MARKED), 1, "{}", mesh.a.log());
    assert_eq!(
        lan_attempts(&mesh.a),
        1,
        "one LAN attempt: {}",
        mesh.a.log()
    );
    let later: Vec<String> = (0..5)
        .map(|i| send_to_bob(&mesh, &format!("later {i}")))
        .collect();
    wait_stored_once(&mesh, &later);
    assert_eq!(lan_attempts(&mesh.a), 1, "no LAN attempt after the mark");
    let all: Vec<String> = first.iter().chain(&later).cloned().collect();
    wait_delivered_via(&mesh.a, &all, "relay");
    assert_eq!(log_lines(&mesh.a, MARKED), 1);
}

/// B's LAN address accepts and never answers: one hang marks it (the 2 s race on the envelope
/// POST: A already has B's enc key from a first message over the LAN), the first message goes
/// through the relay within about 3 s, the queued and later rows never try the LAN.
#[test]
fn a_hung_lan_address_costs_one_race_and_the_first_message_arrives_within_seconds() {
    let stand_in = StandIn::start(Mode::Hang);
    let mesh = mesh_with_b_at(stand_in.addr);
    // A first message over the LAN while the address answers: A pins B's enc key, so the next
    // attempt is the envelope POST itself.
    stand_in.set(Mode::Pass(mesh.b.lan_addr()));
    let m0 = send_to_bob(&mesh, "over the LAN");
    wait_stored_once(&mesh, std::slice::from_ref(&m0));
    wait_delivered_via(&mesh.a, std::slice::from_ref(&m0), "lan");
    assert_eq!(lan_attempts(&mesh.a), 0, "{}", mesh.a.log());
    stand_in.set(Mode::Hang);
    let started = Instant::now();
    let first = send_to_bob(&mesh, "first");
    wait_stored_once(&mesh, std::slice::from_ref(&first));
    let took = started.elapsed();
    eprintln!("hung: first message stored at B after {took:?}");
    assert!(
        took < Duration::from_millis(4_500),
        "the first message took {took:?}"
    );
    assert!(
        mesh.a.log().contains("LAN delivery hangs"),
        "the envelope POST lost the race: {}",
        mesh.a.log()
    );
    let more: Vec<String> = (0..12)
        .map(|i| send_to_bob(&mesh, &format!("more {i}")))
        .collect();
    wait_stored_once(&mesh, &more);
    assert_eq!(log_lines(&mesh.a, MARKED), 1, "{}", mesh.a.log());
    assert_eq!(
        lan_attempts(&mesh.a),
        1,
        "one LAN attempt: {}",
        mesh.a.log()
    );
    let all: Vec<String> = std::iter::once(first).chain(more).collect();
    wait_delivered_via(&mesh.a, &all, "relay");
}

/// A LAN answer that comes after the relay push started: B stores the message once and A's
/// row settles once, with no late verdict to show; then the address answers again (a probe)
/// and new rows go over the LAN.
#[test]
fn a_late_lan_answer_stores_once_and_the_lan_comes_back_when_it_answers() {
    let stand_in = StandIn::start(Mode::Hang);
    let mesh = mesh_with_b_at(stand_in.addr);
    let b_lan = mesh.b.lan_addr();
    // First: the hang marks B, m1 goes through the relay (and A learns B's enc key there).
    let m1 = send_to_bob(&mesh, "m1");
    wait_stored_once(&mesh, std::slice::from_ref(&m1));
    assert_eq!(log_lines(&mesh.a, MARKED), 1);
    // The address answers again but holds each delivery back past the race.
    stand_in.set(Mode::DelayEnvelopes(b_lan, Duration::from_millis(3_500)));
    wait_for("a probe to find B's address answering", || {
        (log_lines(&mesh.a, BACK) >= 1).then_some(())
    });
    let m2 = send_to_bob(&mesh, "m2");
    wait_for("the race to mark B again", || {
        (log_lines(&mesh.a, MARKED) >= 2).then_some(())
    });
    wait_for("the late LAN answer", || {
        (log_lines(&mesh.a, "a late LAN answer came back") >= 1).then_some(())
    });
    wait_stored_once(&mesh, std::slice::from_ref(&m2));
    wait_for("m2 delivered", || {
        (row_route(&mesh.a, &m2).0 == "delivered").then_some(())
    });
    let settled = |host: &Host| -> (String, Option<String>, Option<i64>, Option<String>) {
        host.db()
            .query_row(
                "SELECT state, via, settled_at, late_lan_verdict FROM outbox WHERE msg_id = ?1",
                [&m2],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .expect("row")
    };
    let first_settled = settled(&mesh.a);
    assert_eq!(first_settled.3, None, "the late answer agreed");
    // Both paths have arrived at B: its relay queue is drained (the relay copy pulled and
    // dropped as a duplicate), and the message is stored once.
    mesh.wait_queue_drained(&mesh.b);
    assert_eq!(mesh.b.messages_with_id(&m2), 1);
    // The row settled once: the second path changed nothing, and no alert went to the sender.
    assert_eq!(settled(&mesh.a), first_settled);
    let alerts: i64 = mesh
        .a
        .db()
        .query_row(
            "SELECT COUNT(*) FROM messages WHERE kind = 'alert'",
            [],
            |r| r.get(0),
        )
        .expect("alerts");
    assert_eq!(alerts, 0, "no alert for a row that settled once");
    // The address answers promptly again: a probe clears the mark, new rows go over the LAN.
    stand_in.set(Mode::Pass(b_lan));
    wait_for("a probe to find B's address answering again", || {
        (log_lines(&mesh.a, BACK) >= 2).then_some(())
    });
    let m3 = send_to_bob(&mesh, "m3");
    wait_stored_once(&mesh, std::slice::from_ref(&m3));
    wait_delivered_via(&mesh.a, std::slice::from_ref(&m3), "lan");
}
