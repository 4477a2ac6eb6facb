//! Whether a backup's schema is exactly what this binary defines for its version: every
//! table, index, trigger and view of `sqlite_master`, by type, name and SQL with whitespace
//! runs collapsed. A backup is untrusted input: a trigger or a view is code that would run
//! inside the carry-forward and stay in the live schema, so only the schema's own objects
//! pass, word for word.

use rusqlite::Connection;

use crate::store::maintenance::MaintenanceError;
use crate::store::{migrate, StoreError, MIGRATIONS};

/// One schema object of `sqlite_master`: `(type, name)` → its SQL with whitespace runs
/// collapsed (`None` for the automatic indexes).
type SchemaObjects = std::collections::BTreeMap<(String, String), Option<String>>;

fn normalized_sql(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every table, index, trigger and view of `c` (`sqlite_stat*`, the planner's statistics,
/// left out).
fn schema_objects(c: &Connection) -> rusqlite::Result<SchemaObjects> {
    let mut st = c.prepare(
        "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite\\_stat%' ESCAPE '\\'",
    )?;
    let out = st
        .query_map([], |r| {
            Ok((
                (r.get::<_, String>(0)?, r.get::<_, String>(1)?),
                r.get::<_, Option<String>>(2)?
                    .as_deref()
                    .map(normalized_sql),
            ))
        })?
        .collect::<Result<SchemaObjects, _>>()?;
    Ok(out)
}

/// The schema objects this binary's migrations give a store of schema `version`, built in
/// memory. Errors: SQLite and migration errors.
fn reference_schema(version: u32) -> Result<SchemaObjects, StoreError> {
    let mut c = Connection::open_in_memory()?;
    migrate(&mut c, 0, version, MIGRATIONS)?;
    Ok(schema_objects(&c)?)
}

/// The backup's schema must be exactly what this binary defines for its version: an extra
/// object (a trigger or a view is code that would run inside the carry-forward and stay in the
/// live schema), one of ours defined otherwise (a trigger with another body) or a missing one is
/// refused; the schema's own triggers pass. `Ok(Some)` names the first difference.
pub(super) fn difference(c: &Connection, version: u32) -> Result<Option<String>, MaintenanceError> {
    let found = schema_objects(c).map_err(StoreError::Sqlite)?;
    let want = reference_schema(version)?;
    // A missing table before the indexes it implies.
    if let Some(((kind, name), _)) = want
        .iter()
        .filter(|(k, _)| !found.contains_key(*k))
        .min_by_key(|((kind, _), _)| kind != "table")
    {
        return Ok(Some(format!(
            "the {kind} {name:?} of schema {version} is missing"
        )));
    }
    if let Some(((kind, name), _)) = found.iter().find(|(k, _)| !want.contains_key(*k)) {
        return Ok(Some(format!(
            "it holds a {kind} {name:?} that schema {version} does not define"
        )));
    }
    if let Some(((kind, name), _)) = found.iter().find(|(k, sql)| want.get(*k) != Some(*sql)) {
        return Ok(Some(format!(
            "the {kind} {name:?} differs from its definition in schema {version}"
        )));
    }
    Ok(None)
}
