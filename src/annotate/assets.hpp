// Internal to annotate: the page and its script, embedded at build time from annotate/.
#pragma once

#include <string_view>

namespace pacer::annotate::assets {

extern const std::string_view kPage;        // annotate/page.html, with a /*PACER_ANNOTATE_JS*/ slot
extern const std::string_view kAnnotateJs;  // annotate/annotate.js

}  // namespace pacer::annotate::assets
