// The dashboard's gallery: thumbnails straight from the bucket (presigned URLs) and a viewer that
// shows an image full size, or plays a video from its MP4 (the browser seeks it with range
// requests), with the parameters embedded in it. Inlined before dashboard.js, which passes in its
// fetch and DOM helpers: renderfarmGallery({ getJSON, el, showStatus }) -> { draw(page) }.
"use strict";

// eslint-disable-next-line no-unused-vars
function renderfarmGallery({ getJSON, el, showStatus }) {
  async function openViewer(jobId) {
    const viewer = document.getElementById("viewer");
    const image = await getJSON(`/v1/gallery/${encodeURIComponent(jobId)}`);
    const img = document.getElementById("viewer-img");
    const video = document.getElementById("viewer-video");
    const isVideo = image.kind === "video";
    img.hidden = isVideo;
    video.hidden = !isVideo;
    if (isVideo) {  // the MP4 from the bucket; the browser seeks it with range requests
      video.poster = image.poster_url || "";
      video.src = image.url;
      img.removeAttribute("src");
    } else {
      video.pause();
      video.removeAttribute("src");
      img.src = image.url;
      img.alt = image.prompt;
    }
    const clip = isVideo ? ` · ${image.num_frames} frames at ${image.fps} fps (${image.duration_s} s)` : "";
    document.getElementById("viewer-link").href = image.url;
    document.getElementById("viewer-params").textContent =
      `${image.parameters || image.prompt}\n\n${image.width}×${image.height} · ${image.content_type}${clip} · job ${image.job_id}`;
    viewer.dataset.key = image.job_id;
    if (!viewer.open) viewer.showModal();
  }

  // a video's thumbnail is its animated WebP preview
  const thumbUrl = (image) => (image.kind === "video" && image.preview_url) || image.url;

  function drawGallery(page) {
    const box = document.getElementById("gallery");
    if (!page.images.length) {
      box.replaceChildren(el("p", { class: "muted" }, "no image rendered yet"));
      return;
    }
    const previous = new Map([...box.children].map((figure) => [figure.dataset.key, figure]));
    box.replaceChildren(...page.images.map((image) => {
      let figure = previous.get(image.job_id);
      if (!figure) {
        figure = el("figure");
        figure.dataset.key = image.job_id;
        const img = el("img", { alt: image.prompt, loading: "lazy", width: "126",
          height: String(Math.max(1, Math.round((126 * image.height) / image.width))) });
        // a presigned URL expires: on a load error, take the newest one once
        img.addEventListener("error", () => {
          if (img.dataset.fresh && img.src !== img.dataset.fresh) img.src = img.dataset.fresh;
        });
        img.src = thumbUrl(image);
        const button = el("button", { type: "button", class: "thumb", title: image.prompt });
        button.append(img);
        button.addEventListener("click", () => openViewer(image.job_id).catch((exc) =>
          showStatus(`image ${image.job_id}: ${exc.message || exc}`, true)));
        const badge = image.kind === "video" ? `▶ ${image.duration_s} s · ` : "";
        figure.append(button, el("figcaption", { title: image.prompt }, badge + image.prompt));
      }
      figure.querySelector("img").dataset.fresh = thumbUrl(image);
      return figure;
    }));
  }

  document.getElementById("viewer-close").addEventListener("click", () => document.getElementById("viewer").close());
  document.getElementById("viewer").addEventListener("close", () => document.getElementById("viewer-video").pause());
  return { draw: drawGallery };
}
