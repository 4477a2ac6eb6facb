//! `GET /v1/sent`: the messages an agent sent, newest first, with each recipient's delivery
//! state (spec §9; design README "Local API for agents").

use axum::extract::State;
use axum::Json;
use serde::Deserialize;

use rusqlite::{params, Connection, OptionalExtension};

use crate::mailbox::lan_memory;
use crate::mailbox::receipts::{self, SentPage};
use crate::mailbox::MailboxError;

use super::{ApiError, ApiQuery, SharedState};

/// Query of `GET /v1/sent`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SentQuery {
    /// The agent whose sent messages to list.
    #[serde(rename = "as")]
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Opaque cursor from the previous page's `next_cursor` (empty: the first page).
    #[param(pattern = "^([1-9][0-9]{0,17})?$")]
    pub cursor: Option<String>,
    /// Page size, 1..=100 (default 20); pages are also bounded to 256 KiB.
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
}

/// Lists an agent's sent messages, newest first, each with its per-recipient state: local
/// recipients `delivered`, `read` or `acked`; remote ones from the newest delivery receipt
/// (`delivered`, `notified`, `read`, `acked`), else from the outbox (`queued` with the last
/// attempt's error in `last_error` once one failed, `relay-accepted`, `repush` with its last
/// error, `accepted` (a named agent's host took it but no delivered receipt from that agent has
/// come back: the host holds mail for an agent it does not have until it registers; with a
/// `reason`), `delivered`, `undelivered`, `expired` and `unconfirmed` with their reason).
#[utoipa::path(get, path = "/v1/sent", operation_id = "list_sent", params(SentQuery),
    responses((status = 200, body = SentPage),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    ApiQuery(q): ApiQuery<SentQuery>,
) -> Result<Json<SentPage>, ApiError> {
    super::check_agent(&q.as_agent)?;
    super::check_reader(&state, &q.as_agent).await?;
    let limit = q.limit.unwrap_or(receipts::DEFAULT_SENT_LIMIT);
    if !(1..=receipts::MAX_SENT_LIMIT).contains(&limit) {
        return Err(ApiError::Invalid(format!(
            "limit must be 1..={}",
            receipts::MAX_SENT_LIMIT
        )));
    }
    let host = state.ident.host.to_string();
    let now = state.clock.now_ms();
    let relay = state
        .relay_configured
        .load(std::sync::atomic::Ordering::Acquire);
    let page = state
        .mailbox
        .run(move |c| {
            let mut page = receipts::sent_page(c, &q.as_agent, &host, q.cursor.as_deref(), limit)?;
            annotate_routes(c, &mut page, now, relay)?;
            Ok(page)
        })
        .await?;
    Ok(Json(page))
}

/// Fills `RecipientState::route` (for `queued` and `repush` remote recipients) and
/// `RecipientState::late_lan_verdict` on a sent page at `now_ms`; `relay`: a relay is
/// configured now (the daemon's live flag, [`crate::api::AppState::relay_configured`]), never
/// inferred from what an earlier relay left in the store. Errors: storage faults.
fn annotate_routes(
    conn: &Connection,
    page: &mut SentPage,
    now_ms: i64,
    relay: bool,
) -> Result<(), MailboxError> {
    let relay_in_use = relay;
    for m in &mut page.messages {
        for r in &mut m.recipients {
            if r.state == "queued" || r.state == "repush" {
                r.route = lan_memory::route_text(conn, &r.host, now_ms, relay_in_use)?;
            }
            r.late_lan_verdict = conn
                .query_row(
                    "SELECT late_lan_verdict FROM outbox WHERE msg_id = ?1 AND host = ?2",
                    params![m.id, r.host],
                    |row| row.get(0),
                )
                .optional()?
                .flatten();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::Value;

    use crate::api::{AppState, SharedState};
    use crate::testutil::{self, T0};
    use crate::token::ApiToken;

    #[tokio::test]
    async fn sent_is_behind_the_token_bounded_and_shows_states() {
        crate::install_tls_provider();
        let store = testutil::store();
        let ident = Arc::new(testutil::identity("home"));
        store.register("home", &["bob"]);
        store.add_peer(&testutil::identity("work"), true);
        store
            .send(
                &ident,
                "alice",
                &["bob", "dan@work"],
                "hi",
                "01KDVDNA3VG2MH8KWSQRCWJZ0S",
                T0,
            )
            .unwrap();
        // One failed relay attempt to work: the queued row says why.
        store
            .mailbox
            .with(|c| {
                crate::mailbox::outbox::fail(
                    c,
                    "01KDVDNA3VG2MH8KWSQRCWJZ0S",
                    "work",
                    "relay unreachable: connection refused",
                    false,
                    T0 + 1,
                )
            })
            .unwrap();
        let token = ApiToken::generate();
        let secret = token.expose_secret().to_string();
        let state: SharedState = Arc::new(AppState {
            host: ident.host.clone(),
            token,
            version: crate::VERSION,
            clock: testutil::clock(),
            ident,
            mailbox: store.mailbox.clone(),
            wake: Arc::new(tokio::sync::Notify::new()),
            ids: std::sync::Mutex::new(agentmbx_protocol::ulid::Generator::new()),
            instance: Default::default(),
            lan: Default::default(),
            rates: Default::default(),
            relay_configured: Default::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = crate::api::serve(listener, state, std::future::pending()).await;
        });
        let http = reqwest::Client::new();
        let get = |path: &str, auth: bool| {
            let mut req = http.get(format!("{base}{path}"));
            if auth {
                req = req.bearer_auth(&secret);
            }
            async move {
                let resp = req.send().await.unwrap();
                let status = resp.status().as_u16();
                (status, resp.json::<Value>().await.unwrap_or(Value::Null))
            }
        };
        assert_eq!(get("/v1/sent?as=alice", false).await.0, 401);
        let (status, body) = get("/v1/sent?as=alice&limit=0", true).await;
        assert_eq!((status, body["code"].as_str()), (400, Some("BAD_REQUEST")));
        let (status, body) = get("/v1/sent", true).await;
        assert_eq!((status, body["code"].as_str()), (400, Some("BAD_REQUEST")));
        let (status, body) = get("/v1/sent?as=alice&cursor=junk", true).await;
        assert_eq!((status, body["code"].as_str()), (400, Some("BAD_REQUEST")));
        let (status, body) = get("/v1/sent?as=alice", true).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["next_cursor"], Value::Null);
        let states: Vec<(String, String)> = body["messages"][0]["recipients"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["recipient"].as_str().unwrap().to_string(),
                    r["state"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            states,
            vec![
                ("bob@home".to_string(), "delivered".to_string()),
                ("dan@work".to_string(), "queued".to_string())
            ]
        );
        let recipients = &body["messages"][0]["recipients"];
        assert_eq!(
            recipients[1]["last_error"], "relay unreachable: connection refused",
            "{body}"
        );
        assert!(recipients[0].get("last_error").is_none(), "{body}");
        task.abort();
    }

    /// The route of a queued recipient follows the daemon's live relay flag, not what an earlier
    /// relay left in the store; a late LAN verdict is shown.
    #[test]
    fn routes_follow_the_live_relay_flag_and_late_verdicts_are_shown() {
        use crate::mailbox::lan_memory::{self, DownReason};
        let store = testutil::store();
        let me = testutil::identity("home");
        store.add_peer(&testutil::identity("work"), true);
        let id = "01KDVDNA3VG2MH8KWSQRCWJZ0S";
        store
            .send(&me, "alice", &["bob@work"], "s", id, T0)
            .unwrap();
        store
            .mailbox
            .with(|c| {
                c.execute(
                    "UPDATE peers SET addr = '127.0.0.1:1' WHERE host = 'work'",
                    [],
                )?;
                c.execute(
                    "UPDATE outbox SET late_lan_verdict = 'rejected:too big' WHERE msg_id = ?1",
                    [id],
                )?;
                // A relay that was configured once left its state behind.
                crate::mailbox::relay_state::kv_set(
                    c,
                    "relay-state:https://relay.example",
                    r#"{"state":"ok","at":"2026-01-01T00:00:00.000Z"}"#,
                )?;
                let route = lan_memory::lan_route(c, "work")?;
                lan_memory::mark_down(c, "work", DownReason::Refused, T0, T0 + 5_000, &route)?;
                Ok(())
            })
            .unwrap();
        let page = |relay: bool| {
            store
                .mailbox
                .with(|c| {
                    let mut page = super::receipts::sent_page(c, "alice", "home", None, 10)?;
                    super::annotate_routes(c, &mut page, T0 + 1_000, relay)?;
                    Ok(page)
                })
                .unwrap()
        };
        let off = page(false);
        let r = &off.messages[0].recipients[0];
        let route = r.route.as_deref().unwrap_or_default();
        assert!(route.starts_with("lan (unreachable since"), "{route}");
        assert!(route.ends_with("no relay configured)"), "{route}");
        assert_eq!(r.late_lan_verdict.as_deref(), Some("rejected:too big"));
        let on = page(true);
        let route = on.messages[0].recipients[0]
            .route
            .clone()
            .unwrap_or_default();
        assert!(
            route.starts_with("relay (LAN unreachable since")
                && route.ends_with("next LAN probe in 4 s)"),
            "{route}"
        );
    }
}
