// Internal to the report: the page template, its script and the charting library, embedded at build time.
#pragma once

#include <string_view>

namespace pacer::report::assets {

extern const std::string_view kPage;       // report/page.html, with /*PACER_...*/ slots
extern const std::string_view kReportJs;   // report/report.js
extern const std::string_view kUplotJs;    // uPlot's IIFE build (npm, report/package-lock.json)
extern const std::string_view kUplotCss;
extern const std::string_view kUplotLicense;  // MIT: its notice travels with every page

}  // namespace pacer::report::assets
