//! `GET /v1/search`: full-text search over an agent's mail, ranked, in bounded pages
//! ([`crate::mailbox::search`]: what is searched, how a query is read, the bounds).

use axum::extract::State;
use axum::Json;
use serde::Deserialize;

use crate::mailbox::search::{self, SearchPage};

use super::{ApiError, ApiQuery, SharedState};

/// Query of `GET /v1/search`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SearchQueryParams {
    /// The agent whose mail to search (delivered to it, or sent by it).
    #[serde(rename = "as")]
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Words to find, 2..=200 characters, holding at least one word: ASCII letters and digits
    /// and any other character but white space and controls make words; ASCII punctuation,
    /// spaces and controls separate them (quotes, `NEAR(`, `AND`/`OR`/`NOT`, `subject:`, `^`,
    /// parentheses, `*` mean nothing special). A word directly followed by `*` is a prefix.
    /// A message matches when it holds every word (subject or body; case and diacritics
    /// ignored). A query with no word (only punctuation or spaces) is 400.
    #[param(
        min_length = 2,
        max_length = 200,
        pattern = "[0-9A-Za-z\\u00A1-\\u167F\\u1681-\\u1FFF\\u200B-\\u2027\\u202A-\\u202E\\u2030-\\u205E\\u2060-\\u2FFF\\u3001-\\uFFFF]"
    )]
    pub q: String,
    /// Page size, 1..=50 (default 10); pages are also bounded to 64 KiB.
    #[param(minimum = 1, maximum = 50)]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page of the same search; empty: the first page.
    #[param(pattern = "^([0-9]{1,4})?$")]
    pub cursor: Option<String>,
}

/// Searches the subjects and bodies of the mail an agent can see (delivered to it, or sent by
/// it), best first (bm25), in pages of at most `limit` results and 64 KiB; each result has a
/// body snippet of at most 200 characters, never the whole body. Reads only (marks nothing
/// read). An `as` that is no agent of this host is 404 `UNKNOWN_AGENT`.
#[utoipa::path(get, path = "/v1/search", operation_id = "search", params(SearchQueryParams),
    responses((status = 200, description = "A page of results, best first; `next_cursor` when there are more", body = SearchPage),
        (status = 400, description = "BAD_REQUEST: a missing, unknown or mistyped query parameter (named), or one that breaks its rule: `q` under 2 or over 200 characters or holding no word (only punctuation or spaces), `limit` outside 1..=50, a `cursor` that is not a next_cursor (1 to 4 digits); nothing was done", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    ApiQuery(q): ApiQuery<SearchQueryParams>,
) -> Result<Json<SearchPage>, ApiError> {
    super::check_agent(&q.as_agent)?;
    let limit = q.limit.unwrap_or(search::DEFAULT_SEARCH_LIMIT);
    if !(1..=search::MAX_SEARCH_LIMIT).contains(&limit) {
        return Err(ApiError::Invalid(format!(
            "limit must be 1..={}",
            search::MAX_SEARCH_LIMIT
        )));
    }
    let query = search::parse_query(&q.q)?;
    search::parse_cursor(q.cursor.as_deref())?;
    super::check_reader(&state, &q.as_agent).await?;
    let host = state.ident.host.to_string();
    let page = state
        .mailbox
        .run(move |c| search::search(c, &q.as_agent, &host, &query, q.cursor.as_deref(), limit))
        .await?;
    Ok(Json(page))
}

#[cfg(test)]
mod tests;
