//! Images: `ImportImage` and `BuildImage`, whose requests stream bytes (an archive, a build
//! context) while their responses stream progress.
//!
//! The upload ends like [`crate::transfer`]'s: the last message is the SHA-256 of every chunk,
//! which the daemon requires, so an upload cut short (this side failed to read, or the call was
//! dropped) never counts as complete: the daemon answers ABORTED (no digest) and imports
//! nothing. The request stream is fed from the same task that reads the progress, so memory
//! stays at [`crate::transfer::UPLOAD_QUEUE`] chunks whatever the archive's size.

use sha2::{Digest, Sha256};
use tokio::io::AsyncRead;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{Error, Result};
use crate::proto::{
    build_image_request, import_image_header, import_image_request, BuildImageHeader,
    BuildImageRequest, ImageArchive, ImageInfo, ImageProgress, ImportImageHeader,
    ImportImageRequest,
};
use crate::transfer::{read_chunk, UPLOAD_QUEUE};
use crate::Client;

/// The messages of one upload: a chunk, or the final digest.
trait UploadMessage: Sized {
    fn chunk(data: Vec<u8>) -> Self;
    fn sha256(hex: String) -> Self;
}

impl UploadMessage for ImportImageRequest {
    fn chunk(data: Vec<u8>) -> Self {
        ImportImageRequest {
            item: Some(import_image_request::Item::Chunk(data)),
        }
    }
    fn sha256(hex: String) -> Self {
        ImportImageRequest {
            item: Some(import_image_request::Item::Sha256(hex)),
        }
    }
}

impl UploadMessage for BuildImageRequest {
    fn chunk(data: Vec<u8>) -> Self {
        BuildImageRequest {
            item: Some(build_image_request::Item::Chunk(data)),
        }
    }
    fn sha256(hex: String) -> Self {
        BuildImageRequest {
            item: Some(build_image_request::Item::Sha256(hex)),
        }
    }
}

/// Sends `first`, then `reader`'s bytes in [`crate::transfer::CHUNK_SIZE`] chunks, then their SHA-256. A read
/// error drops `tx` without the digest (the daemon then refuses the upload) and is returned.
async fn feed<M: UploadMessage, R: AsyncRead + Unpin>(
    first: M,
    reader: Option<R>,
    tx: mpsc::Sender<M>,
) -> Result<()> {
    if tx.send(first).await.is_err() {
        return Ok(());
    }
    let Some(mut reader) = reader else {
        return Ok(());
    };
    let mut hasher = Sha256::new();
    loop {
        let chunk = read_chunk(&mut reader).await.map_err(|source| Error::Io {
            what: "cannot read the image upload".to_owned(),
            source,
        })?;
        if chunk.is_empty() {
            break;
        }
        hasher.update(&chunk);
        if tx.send(M::chunk(chunk)).await.is_err() {
            // The call ended: its answer says why.
            return Ok(());
        }
    }
    let _ = tx.send(M::sha256(format!("{:x}", hasher.finalize()))).await;
    Ok(())
}

/// Reads the progress stream to its `done` event, calling `progress` for every event.
async fn follow(
    mut stream: tonic::Streaming<ImageProgress>,
    mut progress: impl FnMut(&ImageProgress),
) -> Result<ImageInfo> {
    while let Some(event) = stream.message().await? {
        progress(&event);
        if let Some(info) = event.done {
            return Ok(info);
        }
    }
    Err(Error::Protocol(
        "the image stream ended without its result".to_owned(),
    ))
}

/// Runs one upload-and-progress call: the feeding and the reading side by side, the local
/// reader's error first (it explains the daemon's refusal that follows from it).
async fn run<M, R, F, Fut>(
    first: M,
    reader: Option<R>,
    call: F,
    progress: impl FnMut(&ImageProgress),
) -> Result<ImageInfo>
where
    M: UploadMessage,
    R: AsyncRead + Unpin,
    F: FnOnce(ReceiverStream<M>) -> Fut,
    Fut: std::future::Future<
        Output = std::result::Result<
            tonic::Response<tonic::Streaming<ImageProgress>>,
            tonic::Status,
        >,
    >,
{
    let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
    let fed = feed(first, reader, tx);
    let followed =
        async move { follow(call(ReceiverStream::new(rx)).await?.into_inner(), progress).await };
    let (fed, followed) = tokio::join!(fed, followed);
    fed?;
    followed
}

impl Client {
    /// Every image of the daemon's catalog, sorted by name.
    pub async fn list_images(&self) -> Result<Vec<ImageInfo>> {
        Ok(self.list_images_fleet().await?.images)
    }

    /// Lists images as [`Client::list_images`] does, with (in a fleet) the nodes holding each
    /// (`ImageInfo.nodes`) and the nodes that did not answer (`unreachable_nodes`).
    pub async fn list_images_fleet(&self) -> Result<crate::proto::ListImagesResponse> {
        let response = self
            .raw()
            .list_images(crate::proto::ListImagesRequest {})
            .await?;
        Ok(response.into_inner())
    }

    /// One image; NOT_FOUND (listing the names there are) when there is none of that name.
    pub async fn get_image(&self, name: impl Into<String>) -> Result<ImageInfo> {
        let request = crate::proto::GetImageRequest { name: name.into() };
        Ok(self.raw().get_image(request).await?.into_inner())
    }

    /// Removes an imported image; returns the bytes freed. FAILED_PRECONDITION while a sandbox
    /// or snapshot uses it, and for the operator's script-built images.
    pub async fn remove_image(&self, name: impl Into<String>) -> Result<u64> {
        let request = crate::proto::RemoveImageRequest { name: name.into() };
        Ok(self
            .raw()
            .remove_image(request)
            .await?
            .into_inner()
            .freed_bytes)
    }

    /// Imports an image of the daemon host's Docker Engine (nothing is pulled) as `name` (empty:
    /// the reference's repository name), calling `progress` for every event. Returns the image.
    pub async fn import_docker_image(
        &self,
        reference: impl Into<String>,
        name: impl Into<String>,
        progress: impl FnMut(&ImageProgress),
    ) -> Result<ImageInfo> {
        let header = ImportImageHeader {
            name: name.into(),
            source: Some(import_image_header::Source::DockerImage(reference.into())),
            shared: false,
        };
        let first = ImportImageRequest {
            item: Some(import_image_request::Item::Header(header)),
        };
        let mut raw = self.raw();
        run(
            first,
            None::<tokio::io::Empty>,
            |body| async move { raw.import_image(body).await },
            progress,
        )
        .await
    }

    /// Imports a `docker save` or OCI image-layout tar read from `archive` (`size` bytes, 0 if
    /// unknown; `file_name` is recorded as its source) as `name` (empty: from the archive's
    /// RepoTags or annotations, else the file name's stem).
    pub async fn import_image_archive(
        &self,
        name: impl Into<String>,
        file_name: impl Into<String>,
        size: u64,
        archive: impl AsyncRead + Unpin,
        progress: impl FnMut(&ImageProgress),
    ) -> Result<ImageInfo> {
        let header = ImportImageHeader {
            name: name.into(),
            source: Some(import_image_header::Source::Archive(ImageArchive {
                size_bytes: size,
                file_name: file_name.into(),
            })),
            shared: false,
        };
        let first = ImportImageRequest {
            item: Some(import_image_request::Item::Header(header)),
        };
        let mut raw = self.raw();
        run(
            first,
            Some(archive),
            |body| async move { raw.import_image(body).await },
            progress,
        )
        .await
    }

    /// Builds an image with the daemon host's Docker Engine from a build context (a tar read
    /// from `context`), then imports it as `header.name`. Build log lines arrive as progress
    /// events of phase `build`.
    pub async fn build_image(
        &self,
        header: BuildImageHeader,
        context: impl AsyncRead + Unpin,
        progress: impl FnMut(&ImageProgress),
    ) -> Result<ImageInfo> {
        let first = BuildImageRequest {
            item: Some(build_image_request::Item::Header(header)),
        };
        let mut raw = self.raw();
        run(
            first,
            Some(context),
            |body| async move { raw.build_image(body).await },
            progress,
        )
        .await
    }
}

/// The rules of a `.dockerignore` file, in the simple form most projects use: one pattern per
/// line, `#` comments, `*` and `?` within a path component, `**` across components, a leading
/// `/` or `./` ignored, a trailing `/` ignored, and `!` re-including what an earlier pattern
/// excluded (the last matching line wins). A matched directory is left out with everything
/// below it.
#[derive(Clone, Debug, Default)]
pub struct DockerIgnore {
    rules: Vec<(bool, Vec<String>)>,
}

impl DockerIgnore {
    /// Parses the text of a `.dockerignore`.
    pub fn parse(text: &str) -> Self {
        let mut rules = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (keep, pattern) = match line.strip_prefix('!') {
                Some(p) => (true, p.trim()),
                None => (false, line),
            };
            let comps: Vec<String> = pattern
                .split('/')
                .filter(|c| !c.is_empty() && *c != ".")
                .map(str::to_owned)
                .collect();
            if !comps.is_empty() {
                rules.push((keep, comps));
            }
        }
        Self { rules }
    }

    /// Whether the path `rel` (relative to the context) is left out.
    pub fn excludes(&self, rel: &std::path::Path) -> bool {
        let comps: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let mut excluded = false;
        for (keep, pattern) in &self.rules {
            if glob_path(pattern, &comps) {
                excluded = !keep;
            }
        }
        excluded
    }
}

/// Whether the components `path` match the pattern components (`**` matches any number).
fn glob_path(pattern: &[String], path: &[String]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first == "**" => {
            (0..=path.len()).any(|skip| glob_path(rest, &path[skip..]))
        }
        Some((first, rest)) => match path.split_first() {
            Some((head, tail)) => glob(first.as_bytes(), head.as_bytes()) && glob_path(rest, tail),
            None => false,
        },
    }
}

/// `*` and `?` within one component.
fn glob(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len()).any(|skip| glob(rest, &name[skip..])),
        Some((b'?', rest)) => !name.is_empty() && glob(rest, &name[1..]),
        Some((c, rest)) => name.first() == Some(c) && glob(rest, &name[1..]),
    }
}

/// Writes the build context `dir` as a tar into `out`: every entry `.dockerignore` (if the
/// directory has one) does not exclude, and the Dockerfile `dockerfile` whatever it says (the
/// builder needs it).
pub fn pack_context<W: std::io::Write>(
    dir: &std::path::Path,
    dockerfile: &str,
    out: W,
) -> std::result::Result<crate::archive::PackReport, crate::archive::ArchiveError> {
    let ignore = match std::fs::read_to_string(dir.join(".dockerignore")) {
        Ok(text) => DockerIgnore::parse(&text),
        Err(_) => DockerIgnore::default(),
    };
    let dockerfile = std::path::Path::new(dockerfile.trim_start_matches("./"));
    crate::archive::pack_filtered(dir, out, &|rel, is_dir| {
        let needed = rel == dockerfile || (is_dir && dockerfile.starts_with(rel));
        needed || !ignore.excludes(rel)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn dockerignore_rules() {
        let ignore = DockerIgnore::parse(
            "# comment\n*.log\n/target/\nnode_modules\n**/secret*\n!keep.log\ndocs/**/draft?\n",
        );
        for out in [
            "a.log",
            "target",
            "node_modules",
            "x/y/secret.txt",
            "secret",
            "docs/a/b/draft1",
        ] {
            assert!(ignore.excludes(Path::new(out)), "{out} is excluded");
        }
        for kept in [
            "keep.log",
            "src/a.log",
            "src/main.rs",
            "docs/draft",
            "targets",
        ] {
            assert!(!ignore.excludes(Path::new(kept)), "{kept} is kept");
        }
    }

    #[test]
    fn the_context_leaves_out_what_dockerignore_says_but_never_the_dockerfile() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("Dockerfile"), "FROM x\n").expect("write");
        std::fs::write(dir.path().join(".dockerignore"), "*\n!app.py\n").expect("write");
        std::fs::write(dir.path().join("app.py"), "print(1)\n").expect("write");
        std::fs::write(dir.path().join("big.bin"), vec![0u8; 1000]).expect("write");
        let mut out = Vec::new();
        pack_context(dir.path(), "Dockerfile", &mut out).expect("pack");
        let mut names: Vec<String> = tar::Archive::new(out.as_slice())
            .entries()
            .expect("tar")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        names.sort();
        assert_eq!(names, ["Dockerfile", "app.py"]);
    }
}
