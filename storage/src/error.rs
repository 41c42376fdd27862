//! The one error type of the storage crate.

/// Everything that can go wrong in a [`crate::Store`] operation.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// RocksDB reported an error (I/O, corruption detected by RocksDB, bad option...).
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    /// A stored key or value does not have the expected layout (short, wrong length,
    /// unknown field byte, non UTF-8 key...). Never a panic.
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// The caller passed something the store refuses to encode (region name longer than
    /// [`crate::MAX_REGION_NAME_BYTES`], key longer than [`crate::MAX_KEY_BYTES`], value
    /// longer than [`crate::MAX_VALUE_BYTES`]). Nothing of the batch was applied.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The data directory was written in a layout this build does not read (a newer
    /// version's, or one more than a version older). Nothing was changed in it.
    #[error(
        "the data directory's {what} format is {found}; this tether reads formats {oldest} to \
         {newest}: run the tether version that wrote it, or one that reads it"
    )]
    IncompatibleFormat {
        /// Which database: `storage` (the queues) or `consensus log` (cluster metadata).
        what: &'static str,
        found: u32,
        oldest: u32,
        newest: u32,
    },
    /// A column family that `open` creates is missing (should be impossible).
    #[error("missing column family {0}")]
    MissingColumnFamily(&'static str),
    /// The in-memory store's mutex was poisoned by a panic while it was held; its
    /// content may be half-updated, so it refuses further work.
    #[error("store lock poisoned")]
    Poisoned,
    /// A file-system operation of the store itself (not RocksDB's) failed.
    #[error("{what}: {source}")]
    Io {
        /// What the store was doing.
        what: &'static str,
        source: std::io::Error,
    },
}

/// Checks a database's recorded format (`record`, a big-endian `u32`, None when the database
/// has none yet) against the formats `oldest..=newest` a build reads. `Ok(true)`: there is no
/// record, and the caller writes its own format.
pub(crate) fn check_format_record(
    what: &'static str,
    record: Option<&[u8]>,
    oldest: u32,
    newest: u32,
) -> Result<bool, StorageError> {
    let Some(v) = record else {
        return Ok(true);
    };
    let bytes: [u8; 4] = v
        .try_into()
        .map_err(|_| StorageError::Corrupt(format!("{what} format record of {} bytes", v.len())))?;
    let found = u32::from_be_bytes(bytes);
    if (oldest..=newest).contains(&found) {
        Ok(false)
    } else {
        Err(StorageError::IncompatibleFormat {
            what,
            found,
            oldest,
            newest,
        })
    }
}
